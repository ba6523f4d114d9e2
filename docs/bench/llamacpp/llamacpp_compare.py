"""Our engine on the llama.cpp backend vs llama.cpp's own tools, on the same GGUF files, threads and
prompts, interleaved prompt by prompt in one run (issue: a llama.cpp backend under the same engine).

Per prompt, in this order: `llama-bench` target-only at the prompt's depth; `llama-speculative` with
the draft model (greedy, then T=0.7 if asked); then our engine: target-only, and each speculative
config. Decode speed excludes the prompt everywhere (llama-bench's tg at depth d, llama-speculative's
"decoded ... speed", our time from the end of the prefill to the last token). Speedups are over the
same tool's own target-only speed on the same prompt; medians over prompts.

    scripts/build-llamacpp-tools.sh llama-bench llama-speculative   # once, same source as the backend
    python docs/bench/llamacpp/llamacpp_compare.py --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b \\
        --prompts humaneval:100-107 --max-new-tokens 64 --out docs/bench/llamacpp/avx512f-vs-llama-tools

Writes results.jsonl (one record per run, appended: a rerun resumes) and report.md in --out.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TOOLS = Path(os.environ.get("DEST", Path.home() / ".cache/specdecode/llama.cpp-tools"))


def tool(name: str) -> list[str]:
    path = TOOLS / "bin" / name
    if not path.exists():
        sys.exit(f"{path} is missing: run scripts/build-llamacpp-tools.sh {name}")
    return [str(path)]


def tool_env() -> dict:
    return os.environ | {"LD_LIBRARY_PATH": str(TOOLS / "build" / "bin")}


def llama_bench(gguf: Path, threads: int, n: int, depth: int) -> dict:
    out = subprocess.run(
        tool("llama-bench")
        + ["-m", str(gguf), "-t", str(threads), "-p", "0", "-n", str(n), "-d", str(depth), "-r", "1", "-o", "json"],
        capture_output=True,
        text=True,
        env=tool_env(),
        check=True,
    ).stdout
    row = json.loads(out)[0]
    return {"decode_tok_s": row["avg_ts"]}


def llama_speculative(
    target: Path, draft: Path, prompt: str, threads: int, n: int, k: int, temp: float, seed: int
) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(prompt)
    try:
        args = tool("llama-speculative") + [
            "-m",
            str(target),
            "-md",
            str(draft),
            "-f",
            f.name,
            "-n",
            str(n),
            "--ignore-eos",
            "-t",
            str(threads),
            "-c",
            "4096",
            "--spec-draft-n-max",
            str(k),
            "--temp",
            str(temp),
            "--seed",
            str(seed),
            "--top-k",
            "0",
            "--top-p",
            "1.0",
            "--min-p",
            "0.0",
        ]  # plain temperature sampling, like ours
        proc = subprocess.run(args, capture_output=True, text=True, env=tool_env())
    finally:
        os.unlink(f.name)
    text = proc.stdout + proc.stderr
    m = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds, speed:\s+([\d.]+) t/s", text)
    if proc.returncode != 0 or not m:
        raise RuntimeError(f"llama-speculative failed ({proc.returncode}): {text[-2000:]}")
    acc = re.search(r"accept\s+=\s+([\d.]+)%", text)
    drafted = re.search(r"n_drafted\s+=\s+(\d+)", text)
    return {
        "decode_tok_s": float(m.group(3)),
        "tokens": int(m.group(1)),
        "acceptance": float(acc.group(1)) / 100 if acc else None,
        "drafted": int(drafted.group(1)) if drafted else None,
    }


def ours(engine, ids: list[int], n: int, temp: float, seed: int) -> dict:
    from specdecode.sampling import SamplingParams

    params = SamplingParams(temperature=temp, seed=seed, max_new_tokens=n, ignore_eos=True)
    seq = engine.add(ids, params)
    start = time.perf_counter()
    while engine.running:
        engine.step()
    elapsed = time.perf_counter() - start
    s = seq.stats
    return {
        "decode_tok_s": len(seq.output_ids) / elapsed,
        "tokens": len(seq.output_ids),
        "acceptance": s.acceptance_rate,
        "tokens_per_step": s.tokens_per_step,
        "token_ids": seq.output_ids,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--prompts", default="humaneval:100-107")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--k", type=int, default=4, help="draft length of the draft-model configs (both tools)")
    ap.add_argument("--temperatures", default="0,0.7")
    ap.add_argument(
        "--configs",
        default="draft-k{k},draft-k2,draft-k8-conf0.4,ngram-k2",
        help="our speculative configs: draft-k<k>[-conf<p>], ngram-k<k>",
    )
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()

    import torch

    from specdecode.bench.prompts import load_prompt_set
    from specdecode.build import EngineConfig, engine_from_pair, load_pair
    from specdecode.models.loading import resolve

    torch.set_num_threads(args.threads)
    target_path, draft_path = resolve(args.target).path, resolve(args.draft).path
    pair = load_pair(EngineConfig(args.target, args.draft, backend="llamacpp", threads=args.threads), "llamacpp")
    prompts = load_prompt_set(args.prompts, None, 0)
    temps = [float(t) for t in args.temperatures.split(",")]
    configs = [c.format(k=args.k) for c in args.configs.split(",")]
    engines = {}

    def engine_for(name: str):
        if name not in engines:
            if name == "target":
                cfg = EngineConfig(
                    args.target, None, num_draft_tokens=0, backend="llamacpp", threads=args.threads, max_context=4096
                )
            else:
                m = re.fullmatch(r"(draft|ngram)-k(\d+)(?:-conf([\d.]+))?", name)
                cfg = EngineConfig(
                    args.target,
                    args.draft if m.group(1) == "draft" else "ngram",
                    num_draft_tokens=int(m.group(2)),
                    backend="llamacpp",
                    threads=args.threads,
                    draft_confidence=float(m.group(3) or 0),
                    max_context=4096,
                )
            engines[name] = engine_from_pair(pair, cfg)
        return engines[name]

    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "results.jsonl"
    done = set()
    if path.exists():
        for line in path.read_text().splitlines():
            r = json.loads(line)
            done.add((r["prompt"], r["temp"], r["tool"], r["config"]))
    meta = {
        "command": " ".join(sys.argv),
        "threads": args.threads,
        "target": str(target_path),
        "draft": str(draft_path),
        "max_new_tokens": args.max_new_tokens,
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip(),
        "cpu_flags": sorted(
            {
                f
                for f in open("/proc/cpuinfo").read().split()
                if f in ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "avx_vnni")
            }
        ),
    }
    (args.out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    with path.open("a") as log:

        def record(rec: dict) -> None:
            rec.pop("token_ids", None)
            log.write(json.dumps(rec) + "\n")
            log.flush()
            print(json.dumps(rec), file=sys.stderr)

        for p in prompts:
            text = p.text
            ids = pair.tokenizer(text, add_special_tokens=False).input_ids
            for temp in temps:
                base = {"prompt": p.id, "temp": temp, "prompt_tokens": len(ids)}
                jobs = []
                if temp == 0:  # llama-bench has no sampling: its speed is the target-only speed for both
                    jobs.append(
                        (
                            "llama.cpp",
                            "target",
                            lambda: llama_bench(target_path, args.threads, args.max_new_tokens, len(ids)),
                        )
                    )
                jobs.append(
                    (
                        "llama.cpp",
                        f"speculative-k{args.k}",
                        lambda: llama_speculative(
                            target_path, draft_path, text, args.threads, args.max_new_tokens, args.k, temp, 0
                        ),
                    )
                )
                for name in ["target"] + configs:
                    jobs.append(
                        (
                            "specdecode",
                            name,
                            lambda name=name: ours(engine_for(name), ids, args.max_new_tokens, temp, 0),
                        )
                    )
                for tool_name, config, run in jobs:
                    if (p.id, temp, tool_name, config) in done:
                        continue
                    record(base | {"tool": tool_name, "config": config} | run())
    write_report(args.out)
    return 0


def write_report(out: Path) -> None:
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    meta = json.loads((out / "meta.json").read_text())
    base = {(r["prompt"], r["temp"], r["tool"]): r["decode_tok_s"] for r in rows if r["config"] == "target"}
    for (prompt, temp, tool_name), speed in list(base.items()):  # llama-bench does not sample: one speed for all
        if tool_name == "llama.cpp":
            for t in {r["temp"] for r in rows}:
                base.setdefault((prompt, t, tool_name), speed)
    lines = [
        "# specdecode on llama.cpp vs llama.cpp's own tools",
        "",
        f"- command: `{meta['command']}` (commit {meta['commit']})",
        f"- threads {meta['threads']}; CPU flags {', '.join(meta['cpu_flags'])}; "
        f"{meta['max_new_tokens']} new tokens per prompt, EOS ignored",
        f"- target {meta['target']}, draft {meta['draft']}",
        "- decode tok/s exclude the prompt; speedup = over the same tool's target-only on the same prompt "
        "(llama.cpp: llama-bench tg at the prompt's depth); medians over prompts",
        "",
        "| temp | tool | config | prompts | decode tok/s | speedup | acceptance | tokens/step |",
        "|---|---|---|---|---|---|---|---|",
    ]
    keys = sorted(
        {(r["temp"], r["tool"], r["config"]) for r in rows}, key=lambda k: (k[0], k[1], k[2] != "target", k[2])
    )
    for temp, tool_name, config in keys:
        sel = [r for r in rows if (r["temp"], r["tool"], r["config"]) == (temp, tool_name, config)]
        speed = [
            r["decode_tok_s"] / base[(r["prompt"], temp, tool_name)]
            for r in sel
            if (r["prompt"], temp, tool_name) in base
        ]
        acc = [r["acceptance"] for r in sel if r.get("acceptance") is not None]
        tps = [r["tokens_per_step"] for r in sel if r.get("tokens_per_step") is not None]

        def med(xs, fmt):
            return format(statistics.median(xs), fmt) if xs else "–"

        lines.append(
            f"| {temp} | {tool_name} | {config} | {len(sel)} | {med([r['decode_tok_s'] for r in sel], '.2f')} "
            f"| {med(speed, '.2f')}× | {med(acc, '.2f')} | {med(tps, '.2f')} |"
        )
    (out / "report.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())

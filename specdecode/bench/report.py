"""Turn a benchmark's records into ``results.json`` (every raw record plus the summaries),
``report.md`` and four PNG plots."""

from __future__ import annotations

import dataclasses
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from specdecode.bench import analysis as A

PLOTS = ("speedup_vs_k.png", "acceptance_by_position.png", "speedup_vs_context.png", "predicted_vs_measured.png")


@dataclasses.dataclass
class Summary:
    cells: list[A.Cell]
    context: list[A.BucketCell]
    break_even: dict[str, list[A.BreakEven]]  # category -> rows
    checks: list[dict[str, Any]]
    break_even_categories: list[str]  # categories with speculative runs
    prompts: list[dict[str, Any]]
    latency: list[A.LatencyCell] = dataclasses.field(default_factory=list)
    latency_after_prefill: list[A.LatencyCell] = dataclasses.field(default_factory=list)

    def cell(self, sampling: str, config: str, group: str = "overall") -> A.Cell | None:
        return next((c for c in self.cells if (c.sampling, c.config, c.group) == (sampling, config, group)), None)

    def samplings(self) -> list[str]:
        return list(dict.fromkeys(c.sampling for c in self.cells))

    def configs(self, sampling: str) -> list[str]:
        return list(dict.fromkeys(c.config for c in self.cells if c.sampling == sampling))

    def groups(self) -> list[str]:
        return list(dict.fromkeys(c.group for c in self.cells))

    def spec_cells(self, sampling: str, group: str = "overall") -> list[A.Cell]:
        """Chain configurations with the draft as loaded (the per-k plots and formulas); trees and
        quantized drafts are in the tables."""
        return [
            c
            for c in self.cells
            if c.sampling == sampling
            and c.group == group
            and c.k > 0
            and not A.is_tree(c.config)
            and "@" not in c.config
        ]


def summarize(records: list[dict[str, Any]]) -> Summary:
    runs = A.runs_of(records)
    categories = sorted({r["category"] for r in runs if r.get("k", 0) > 0})
    return Summary(
        cells=A.summarize(records),
        context=A.by_context(records),
        break_even={cat: A.break_even_table(records, cat) for cat in categories},
        checks=[r for r in records if r.get("type") == "check"],
        break_even_categories=categories,
        prompts=A.prompt_rows(records),
        latency=A.latency_cells(records),
        latency_after_prefill=A.latency_cells(records, after_prefill=True),
    )


def write_report(out_dir: Path, records: list[dict[str, Any]], meta: dict[str, Any]) -> Summary:
    summary = summarize(records)
    sessions = [r for r in records if r.get("type") == "session"]
    results = {
        "meta": meta,
        "definitions": A.DEFINITIONS,
        "sessions": sessions,
        "summary": {
            "cells": [dataclasses.asdict(c) for c in summary.cells],
            "context": [dataclasses.asdict(c) for c in summary.context],
            "break_even": {
                cat: [dataclasses.asdict(r) | {"below": r.below, "pays": r.pays} for r in rows]
                for cat, rows in summary.break_even.items()
            },
            "latency": [dataclasses.asdict(c) for c in summary.latency],
            "latency_after_prefill": [dataclasses.asdict(c) for c in summary.latency_after_prefill],
            "checks": summary.checks,
            "prompts": summary.prompts,
        },
        "records": [r for r in records if r.get("type") in ("run", "check")],
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    choices, structured = _choices_section(records), structured_section(records)
    choices += ([""] if choices and structured else []) + structured
    (out_dir / "report.md").write_text(
        markdown(summary, meta, sessions) + ("\n" + "\n".join(choices) + "\n" if choices else ""), encoding="utf-8"
    )
    plot(summary, out_dir)
    return summary


# -- Markdown -------------------------------------------------------------------------------------
def _n(value: float | None, fmt: str = ".2f") -> str:
    return "–" if value is None else format(value, fmt)


def markdown(summary: Summary, meta: dict[str, Any], sessions: list[dict[str, Any]]) -> str:
    s = meta.get("settings", {})
    lines = [f"# Speculative decoding benchmark: {s.get('target')} ← {s.get('draft')}", ""]
    if meta.get("interrupted"):
        lines += [
            "**Incomplete**: the run was interrupted; only finished runs are included. Rerun the same "
            "command to resume.",
            "",
        ]
    lines += _setup(meta, sessions)
    for sampling in summary.samplings():
        lines += ["", f"## Results: {sampling}", "", *_overall_table(summary, sampling)]
        lines += ["", *_category_table(summary, sampling)]
        lines += ["", *_position_table(summary, sampling)]
        lines += ["", *_context_table(summary, sampling)]
        lines += ["", *_latency_table(summary.latency, sampling)]
        lines += ["", *_latency_table(summary.latency_after_prefill, sampling, after_prefill=True)]
    for cat in summary.break_even_categories:
        lines += ["", *_break_even_section(summary, cat)]
    lines += ["", *_peer_section(summary), "", *_checks_section(summary), "", *_prompt_table(summary)]
    lines += ["", "## Plots", ""] + [f"![{p[:-4]}]({p})" for p in PLOTS]
    lines += ["", "## Definitions", "", A.DEFINITIONS, ""]
    return "\n".join(lines)


def structured_section(records: list[dict[str, Any]]) -> list[str]:
    """Structured prompts (a ``response_format``, e.g. json_extract): per sampling setting and config, whether
    the grammar was on and how many outputs (cut at the first end token) parsed as JSON and were valid against
    the schema. Empty when no run had one."""
    runs = [r for r in records if r.get("type") == "run" and "json_parsed" in r]
    if not runs:
        return []
    lines = [
        "## Structured outputs",
        "",
        "Prompts with a response_format: outputs (up to the first end token) that parse as JSON, and that are "
        "valid against the prompt's schema (jsonschema). With the grammar on (the default; bench --no-grammar "
        "turns it off) the engine's outputs follow the schema by construction, cut only by max_new_tokens; the "
        "transformers baselines never apply it.",
        "",
        "Mask time: the grammar engine's time computing and applying the masks (target and draft rows), per "
        "generated token and as a share of the runs' wall time.",
        "",
        "| sampling | config | grammar | outputs | parsed JSON | valid | mask ms / token | mask ms / row | "
        "mask share of wall |",
        "|---" * 9 + "|",
    ]
    groups: dict[tuple[str, str, bool], list[dict[str, Any]]] = defaultdict(list)
    for r in runs:
        groups[(r["sampling"], r["config"], bool(r.get("grammar")))].append(r)
    for (sampling, config, grammar), rs in sorted(groups.items(), key=lambda kv: (kv[0][0], A._config_order(kv[0][1]))):
        parsed = sum(1 for r in rs if r["json_parsed"])
        valid = sum(1 for r in rs if r.get("json_valid"))
        timed = [r for r in rs if "mask_s" in r]
        mask = "– | – | –"
        if timed:
            mask_s, rows = sum(r["mask_s"] for r in timed), sum(r["mask_rows"] for r in timed)
            tokens, wall = sum(r["new_tokens"] for r in timed), sum(r["wall_s"] for r in timed)
            mask = (
                f"{1e3 * mask_s / max(tokens, 1):.2f} | {1e3 * mask_s / max(rows, 1):.2f} | {mask_s / wall:.1%}"
                if wall
                else "– | – | –"
            )
        lines.append(
            f"| {sampling} | {config} | {'on' if grammar else 'off'} | {len(rs)} | {parsed} "
            f"({parsed / len(rs):.0%}) | {valid} ({valid / len(rs):.0%}) | {mask} |"
        )
    return lines


def _choices_section(records: list[dict[str, Any]]) -> list[str]:
    """Share of target steps per choice of ``--draft-policy auto``, by sampling and category."""
    from collections import Counter, defaultdict

    by: dict[tuple[str, str], Counter] = defaultdict(Counter)
    for r in records:
        if r.get("type") == "run" and (r.get("stats") or {}).get("choices"):
            for key in ((r["sampling"], "overall"), (r["sampling"], r.get("category", "?"))):
                by[key].update(r["stats"]["choices"])
    if not by:
        return []
    lines = [
        "## What --draft-policy auto chose",
        "",
        "Share of target steps by choice (`<drafter>:k<k>`, or `off` = no drafting), over the `auto` runs.",
        "",
        "| sampling | category | choices |",
        "|---|---|---|",
    ]
    for (sampling, group), counts in sorted(by.items(), key=lambda kv: (kv[0][0], kv[0][1] != "overall", kv[0][1])):
        total = sum(counts.values())
        top = ", ".join(f"{label} {n / total:.0%}" for label, n in counts.most_common(8))
        lines.append(f"| {sampling} | {group} | {top} |")
    return lines + _why_plain(records, by)


def _why_plain(records: list[dict[str, Any]], by: dict) -> list[str]:
    """Where ``auto`` decoded plainly in most steps: the costs and acceptance it saw (its last run's)."""
    lines = []
    for (sampling, group), counts in sorted(by.items()):
        off = counts.get("off", 0) / max(1, sum(counts.values()))
        if group != "overall" or off < 0.5:
            continue
        last = next(
            (
                r
                for r in reversed(records)
                if r.get("type") == "run" and r.get("sampling") == sampling and r.get("policy")
            ),
            None,
        )
        if last is None:
            continue
        why = last["policy"]
        verify = ", ".join(f"v({w}) = {s / why['step_s']:.2f}" for w, s in why["verify_s"].items())
        lines += [
            "",
            f"### Why `auto` decoded plainly in {off:.0%} of its {sampling} steps",
            "",
            f"At the costs it measured (a plain step {why['step_s'] * 1e3:.1f} ms; {verify} steps; calibration "
            f"taken on a {why['calibration']} machine: {why['noise']}) and the acceptance it saw, no drafter "
            f"beat plain decoding by the {why['margin']:.0%} margin it asks:",
            "",
            "| drafter | tried | α | tokens judged | c (a draft token / a step) | best k | speed × plain |",
            "|---|---|---|---|---|---|---|",
        ]
        for d, x in why["drafters"].items():
            lines.append(
                f"| {d} | {'yes' if x['tried'] else 'no'} | {x['alpha']:.2f} | {x['tokens_judged']:g} | "
                f"{x['draft_token_s'] / why['step_s']:.2f} | {x['best_k']} | {x['speed_vs_plain']:.2f} |"
            )
    return lines


def _setup(meta: dict[str, Any], sessions: list[dict[str, Any]]) -> list[str]:
    s, m = meta.get("settings", {}), meta.get("machine", {})
    lines = ["## Setup", ""]
    for cmd in meta.get("commands", []):
        lines.append(f"- command: `{cmd}`")
    lines += [
        f"- commit: `{meta.get('commit')}`",
        f"- machine: {m.get('cpu')}, {m.get('cores')} cores ({m.get('torch_threads')} torch threads), "
        f"{m.get('ram_gib')} GiB RAM, CPU flags: {m.get('cpu_flags')}; {m.get('note', '')}",
        "- versions: " + ", ".join(f"{k} {v}" for k, v in meta.get("versions", {}).items()),
        f"- models: target `{s.get('target')}`, draft `{s.get('draft')}`, "
        + (
            f"{s.get('dtype')}"
            if s.get("backend", "torch") == "torch"
            else f"{s.get('backend')} backend (the .gguf files' own quantization, {s.get('threads') or 'all'} threads)"
        )
        + ", batch 1"
        + (
            f"; **LOSSY: the target run was quantized to {s['target_quantization']}** (--target-quantization), "
            "not the model named"
            if s.get("target_quantization", "none") != "none"
            else ""
        )
        + (
            f"; **LOSSY: {s['acceptance']} acceptance** (epsilon, alpha = {s.get('typical')}): sampled speculative "
            "outputs do not follow the target's law"
            if s.get("acceptance", "exact") != "exact"
            else ""
        ),
        "- draft length of spec-k<k>: " + (s.get("draft_schedule") or "fixed k"),
        "- sampler: "
        + (
            "**coupled** (`--sampler coupled`: each position's token is the target's exponential-race "
            "choice under noise keyed by (seed, position); a draft is accepted iff it equals it)"
            if s.get("sampler") == "coupled"
            else "rejection sampling (Leviathan et al.)"
        ),
        f"- {s.get('max_new_tokens')} new tokens per prompt, "
        + (
            "EOS ignored (every run generates the full budget; fill-in-the-middle prompts still end at the "
            "model's FIM end tokens and their editor rule, within their own caps)"
            if s.get("ignore_eos")
            else "stop at EOS"
        )
        + f"; {s.get('repeats')} repeat(s) per (prompt, config), medians"
        + (
            "; each repeat a pass over the prompts, before which every drafter forgets the outputs it kept "
            "(a repeat never drafts from its own earlier output)"
            if (s.get("repeats") or 1) > 1
            else ""
        )
        + f"; warm-up excluded; seed {s.get('seed')}",
        f"- prompts: {meta.get('prompt_summary', '')}",
    ]
    for sess in sessions:
        lines.append(
            f"- session {sess.get('started')} → {sess.get('ended')}: {sess.get('runs')} runs, "
            f"peak RSS {_n(sess.get('peak_rss_gib'))} GiB, load average {sess.get('loadavg_start')} → "
            f"{sess.get('loadavg_end')}"
        )
    return lines


def _overall_table(summary: Summary, sampling: str) -> list[str]:
    lines = [
        "All prompts. Speedups are over this engine's target-only decoding: end to end (prefill included) and "
        "decode only; predicted = E / (k·c + 1) (Leviathan et al.), predicted (v) = E / (k·c + v); the last "
        "column is decode speedup / predicted. Trees (spec-k<depth>-t<T>n<N>): acceptance is accepted tokens "
        "per unit of depth, nodes = draft tokens verified per step, v = v(nodes); no chain formula applies.",
        "",
        "| config | prompts | tok/s | speedup | decode speedup | acceptance | α | tokens/step | nodes/step "
        "| E(α,k) | c | v | predicted | predicted (v) | measured / predicted | predicted (v, steps) "
        "| measured / predicted (v, steps) |",
        "|---" * 17 + "|",
    ]
    for c in summary.cells:
        if c.sampling == sampling and c.group == "overall":
            lines.append(
                f"| {c.config} | {c.n_prompts} | {c.tok_s:.3f} | {_n(c.speedup)} | {_n(c.decode_speedup)} "
                f"| {_n(c.acceptance_rate, '.3f')} "
                f"| {_n(c.alpha, '.3f')} | {_n(c.tokens_per_step)} | {_n(c.nodes_per_step, '.1f')} "
                f"| {_n(c.expected_tokens_per_step)} "
                f"| {_n(c.c, '.3f')} | {_n(c.v)} | {_n(c.predicted_speedup)} | {_n(c.predicted_speedup_v)} "
                f"| {_n(c.efficiency)} | {_n(c.predicted_speedup_steps)} | {_n(c.efficiency_steps)} |"
            )
    return lines


def _category_table(summary: Summary, sampling: str) -> list[str]:
    groups = [g for g in summary.groups() if g != "overall"]
    if not groups:
        return []
    configs = [c for c in summary.configs(sampling) if c != A.TARGET]
    lines = [
        "Per category: speedup end to end / decode only (acceptance rate); target-only tok/s in the second "
        "column. With few prompts per category the end-to-end figure carries the prefill's noise.",
        "",
        "| category | prompts | target tok/s | " + " | ".join(configs) + " |",
        "|---" * (len(configs) + 3) + "|",
    ]
    for g in groups + ["overall"]:
        base = summary.cell(sampling, A.TARGET, g)
        row = [g, str(base.n_prompts) if base else "–", _n(base.tok_s if base else None, ".3f")]
        for name in configs:
            c = summary.cell(sampling, name, g)
            if c is None:
                row.append("–")
                continue
            decode = f" / {c.decode_speedup:.2f}" if c.decode_speedup is not None else ""
            acc = f" ({c.acceptance_rate:.2f})" if c.acceptance_rate is not None else ""
            row.append(_n(c.speedup) + decode + acc)
        lines.append("| " + " | ".join(row) + " |")
    return lines


def _position_table(summary: Summary, sampling: str) -> list[str]:
    cells = summary.spec_cells(sampling)
    if not cells:
        return []
    width = max(len(c.acceptance_by_position) for c in cells)
    lines = [
        "Acceptance by draft position (all prompts): the rate at which the j-th draft token was accepted "
        "among steps that drafted it.",
        "",
        "| config | " + " | ".join(f"j={j + 1}" for j in range(width)) + " |",
        "|---" * (width + 1) + "|",
    ]
    for c in cells:
        vals = c.acceptance_by_position + [None] * (width - len(c.acceptance_by_position))
        lines.append(f"| {c.config} | " + " | ".join(_n(v) for v in vals) + " |")
    return lines


def _context_table(summary: Summary, sampling: str) -> list[str]:
    cells = [c for c in summary.context if c.sampling == sampling]
    if not cells:
        return []
    buckets = [label for _, _, label in A.BUCKETS if any(c.bucket == label for c in cells)]
    configs = list(dict.fromkeys(c.config for c in cells))
    lines = [
        "By context length (prompt + generated so far) at each step: decode tok/s (speedup over target-only "
        "in the same bucket).",
        "",
        "| config | " + " | ".join(buckets) + " |",
        "|---" * (len(buckets) + 1) + "|",
    ]
    for name in configs:
        row = [name]
        for b in buckets:
            c = next((x for x in cells if x.config == name and x.bucket == b), None)
            row.append(
                "–"
                if c is None
                else f"{c.tok_s:.2f}" + ("" if c.speedup is None or name == A.TARGET else f" ({c.speedup:.2f}×)")
            )
        lines.append("| " + " | ".join(row) + " |")
    return lines


def _latency_table(latency: list[A.LatencyCell], sampling: str, after_prefill: bool = False) -> list[str]:
    cells = [c for c in latency if c.sampling == sampling]
    if not cells:
        return []
    groups = list(dict.fromkeys(c.group for c in cells))
    groups = [g for g in groups if g != "overall"] + ["overall"]
    configs = list(dict.fromkeys(c.config for c in cells))
    what = (
        "Latency after prefill: time from the end of the prompt's prefill to the last token (a request whose "
        "prompt is already cached; a drafter reading the prompt late pays that inside)"
        if after_prefill
        else "Latency: time to the last token of a request (prefill included)"
    )
    lines = [
        f"{what}, p50 / p99 seconds over every run (ratio to target-only's on the same prompts: p50× / p99×).",
        "",
        "| config | " + " | ".join(groups) + " |",
        "|---" * (len(groups) + 1) + "|",
    ]
    for name in configs:
        row = [name]
        for g in groups:
            c = next((x for x in cells if x.config == name and x.group == g), None)
            if c is None:
                row.append("–")
                continue
            ratio = "" if name == A.TARGET or c.p50_ratio is None else f" ({c.p50_ratio:.2f}× / {c.p99_ratio:.2f}×)"
            row.append(f"{c.p50_s:.2f} / {c.p99_s:.2f}{ratio}")
        lines.append("| " + " | ".join(row) + " |")
    return lines


MAX_PROMPT_ROWS = 120


def _prompt_table(summary: Summary) -> list[str]:
    """Prompt x config: tok/s (speedup; acceptance rate), one row per (sampling, prompt)."""
    by: dict[tuple[str, str], dict[str, dict[str, Any]]] = defaultdict(dict)
    for row in summary.prompts:
        by[(row["sampling"], row["prompt_id"])][row["config"]] = row
    if not by:
        return []
    configs = list(dict.fromkeys(r["config"] for r in summary.prompts))
    configs.sort(key=A._config_order)
    lines = [
        "## Per prompt",
        "",
        "tok/s (speedup over target-only; acceptance rate), medians over repeats.",
        "",
        "| sampling | prompt | category | " + " | ".join(configs) + " |",
        "|---" * (len(configs) + 3) + "|",
    ]
    for n, ((sampling, pid), cells) in enumerate(by.items()):
        if n == MAX_PROMPT_ROWS:
            lines.append(f"\n({len(by) - n} more rows in results.json, summary.prompts)")
            break
        row = [sampling, pid, next(iter(cells.values()))["category"]]
        for config in configs:
            c = cells.get(config)
            if c is None:
                row.append("–")
                continue
            extra = [f"{c['speedup']:.2f}×"] if c["speedup"] is not None and config != A.TARGET else []
            extra += [f"{c['acceptance_rate']:.2f}"] if c["acceptance_rate"] is not None else []
            row.append(f"{c['tok_s']:.2f}" + (f" ({'; '.join(extra)})" if extra else ""))
        lines.append("| " + " | ".join(row) + " |")
    return lines


def _break_even_section(summary: Summary, category: str) -> list[str]:
    rows = summary.break_even[category]
    if not rows:
        return []
    lines = [
        f"## Break-even: {category}",
        "",
        "Per configuration, over its prompts. Chains: the acceptance α at which drafting just pays for "
        "itself given the measured c (formula, v = 1) and with the measured verification cost v. Every "
        "configuration (lookup, auto, trees): the tokens per decode step it needed to pay (its step's wall "
        "time over target-only's) against what it got; a prompt pays when got > needed.",
        "",
        "| sampling | config | prompts | median α | median c | break-even α | prompts below | "
        "break-even α (v) | prompts below (v) | median tokens/step got / needed | prompts paying "
        "| prompts with speedup < 1 |",
        "|---" * 12 + "|",
    ]
    by: dict[tuple[str, str], list[A.BreakEven]] = defaultdict(list)
    for r in rows:
        by[(r.sampling, r.config)].append(r)
    for (sampling, config), rs in by.items():
        alphas = [r.alpha for r in rs if r.alpha is not None]
        cs = [r.c for r in rs if r.c is not None]
        k, c_med = rs[0].k, A.median(cs)
        v_med = A.median([r.v for r in rs if r.v is not None])
        chain = not A.is_tree(config)
        be = A.break_even_alpha(k, c_med) if chain and c_med is not None else None
        be_v = A.break_even_alpha(k, c_med, v_med) if chain and c_med is not None and v_med is not None else None
        below = sum(1 for r in rs if r.below)
        below_v = sum(
            1
            for r in rs
            if chain
            and r.alpha is not None
            and r.c is not None
            and (r.break_even_v is None or r.alpha < r.break_even_v)
        )
        slow = sum(1 for r in rs if r.speedup is not None and r.speedup < 1)
        got = A.median([r.tokens_per_step for r in rs if r.tokens_per_step is not None])
        needed = A.median([r.needed_tokens_per_step for r in rs if r.needed_tokens_per_step is not None])
        paying = sum(1 for r in rs if r.pays)
        formula = [_be(be), str(below), _be(be_v), str(below_v)] if chain else ["–", "–", "–", "–"]
        lines.append(
            f"| {sampling} | {config} | {len(rs)} | {_n(A.median(alphas), '.3f')} | {_n(c_med, '.3f')} | "
            + " | ".join(formula)
            + f" | {_n(got)} / {_n(needed)} | {paying} | {slow} |"
        )
    lines += [
        "",
        *_verdict(summary, category),
        "",
        *_per_prompt_table(summary, category),
        "",
        *_per_request_table(summary, category),
    ]
    return lines


def _be(value: float | None) -> str:
    return "never (k·c + v ≥ k + 1)" if value is None else f"{value:.3f}"


def _per_prompt_table(summary: Summary, category: str) -> list[str]:
    rows = summary.break_even[category]
    best = {s: _best(summary, s, category) for s in summary.samplings()}
    chosen = [r for r in rows if best.get(r.sampling) is not None and r.config == best[r.sampling].config]
    if not chosen:
        return []
    lines = [
        "Per prompt at the best draft length of each sampling setting (below = α under the formula's break-even):",
        "",
        "| sampling | config | prompt | α | acceptance | c | v | break-even α | below | speedup |",
        "|---" * 10 + "|",
    ]
    for r in chosen:
        lines.append(
            f"| {r.sampling} | {r.config} | {r.prompt_id} | {_n(r.alpha, '.3f')} | {_n(r.acceptance_rate, '.3f')} "
            f"| {_n(r.c, '.3f')} | {_n(r.v)} | {_be(r.break_even)} | {'yes' if r.below else 'no'} "
            f"| {_n(r.speedup)} |"
        )
    return lines


def _per_request_table(summary: Summary, category: str) -> list[str]:
    """Every prompt x speculative configuration: tokens per step got / needed (✓ when it paid) and the
    latency ratio to target-only."""
    rows = summary.break_even[category]
    if not rows:
        return []
    configs = sorted({r.config for r in rows}, key=A._config_order)
    by: dict[tuple[str, str], dict[str, A.BreakEven]] = defaultdict(dict)
    for r in rows:
        by[(r.sampling, r.prompt_id)][r.config] = r
    lines = [
        "Per request: tokens per decode step got / needed to pay (✓ paid), and the time to the last token "
        "against target-only's (×); target-only's own latency in seconds.",
        "",
        "| sampling | prompt | target-only s | " + " | ".join(configs) + " |",
        "|---" * (len(configs) + 3) + "|",
    ]
    for n, ((sampling, pid), cells) in enumerate(by.items()):
        if n == MAX_PROMPT_ROWS:
            lines.append(f"\n({len(by) - n} more rows in results.json, summary.break_even)")
            break
        ref = next((r for r in cells.values() if r.latency_s is not None and r.latency_ratio), None)
        target_s = ref.latency_s / ref.latency_ratio if ref is not None else None
        row = [sampling, pid, _n(target_s)]
        for config in configs:
            r = cells.get(config)
            row.append(
                "–"
                if r is None
                else f"{_n(r.tokens_per_step)} / {_n(r.needed_tokens_per_step)}"
                + (" ✓" if r.pays else "")
                + (f", {r.latency_ratio:.2f}×" if r.latency_ratio is not None else "")
            )
        lines.append("| " + " | ".join(row) + " |")
    return lines


def _best(summary: Summary, sampling: str, group: str) -> A.Cell | None:
    """The fastest speculative cell of a group that drafted (a lone category is reported as "overall")."""
    if group not in summary.groups():
        group = "overall"
    cells = [c for c in summary.spec_cells(sampling, group) if c.speedup is not None and drafted(c)]
    return max(cells, key=lambda c: c.speedup) if cells else None


def drafted(cell: A.Cell) -> bool:
    """Did the configuration draft at all (``auto`` may decode plainly throughout)?"""
    return (cell.alpha is not None and (cell.tokens_per_step or 1.0) > 1.0) or bool(cell.nodes_per_step)


def _verdict(summary: Summary, category: str) -> list[str]:
    out = ["**Verdict (generated from the numbers above).**"]
    for sampling in summary.samplings():
        best = _best(summary, sampling, category)
        if best is None:
            if summary.spec_cells(sampling, category if category in summary.groups() else "overall"):
                out.append(
                    f"- {sampling}: no configuration drafted, so there is nothing to judge speculation by "
                    "(why `auto` did not: its section below the tables)."
                )
            continue
        be = A.break_even_alpha(best.k, best.c) if best.c is not None else None
        rows = [r for r in summary.break_even[category] if r.sampling == sampling and r.config == best.config]
        below = sum(1 for r in rows if r.below)
        pays = best.speedup is not None and best.speedup > 1
        text = (
            f"{sampling}: speculation {'pays' if pays else 'does not pay'} for {category} on this pair and machine; "
            f"the best draft length is k = {best.k} at {best.speedup:.2f}× target-only "
            f"(α = {_n(best.alpha, '.3f')}, c = {_n(best.c, '.3f')}, v = {_n(best.v)}). "
            f"The formula predicts {_n(best.predicted_speedup)}× (with the measured v: "
            f"{_n(best.predicted_speedup_v)}×); measured/predicted = {_n(best.efficiency)} is the overhead the "
            f"formula leaves out, verification costing v target steps instead of 1 among it. "
            f"At k = {best.k} drafting breaks even at α = {_be(be)} (formula) or {_be(A.break_even_alpha(best.k, best.c, best.v) if best.c is not None and best.v is not None else None)} "
            f"(with v); {below} of {len(rows)} prompts fall below the formula's."
        )
        out.append(f"- {text}")
    return out


def _peer_section(summary: Summary) -> list[str]:
    lines = ["## Against `transformers`", ""]
    found = False
    for sampling in summary.samplings():
        target, hf = summary.cell(sampling, A.TARGET), summary.cell(sampling, "hf")
        assisted, best = summary.cell(sampling, "hf-assisted"), _best(summary, sampling, "overall")
        if hf is not None and target is not None:
            found = True
            lines.append(
                f"- {sampling}: target-only, this engine {target.tok_s:.3f} tok/s vs `generate` "
                f"{hf.tok_s:.3f} tok/s: {target.tok_s / hf.tok_s:.2f}×"
            )
        if assisted is not None and best is not None:
            found = True
            lines.append(
                f"- {sampling}: best speculative setting {best.config} {best.tok_s:.3f} tok/s vs assisted "
                f"generation {assisted.tok_s:.3f} tok/s: {best.tok_s / assisted.tok_s:.2f}×"
            )
    return lines if found else []


def _checks_section(summary: Summary) -> list[str]:
    if not summary.checks:
        return []
    lines = [
        "## Greedy exactness",
        "",
        "Every greedy output is compared with this engine's target-only output for the same prompt. "
        "A mismatch is shown with the target's logits at the first diverging position (teacher-forced on "
        "the common prefix): a near-tie (gap within two rounding units of the logit) is numerics, not a bug.",
        "",
        "| config | compared | equal | mismatches | near-ties |",
        "|---" * 5 + "|",
    ]
    by: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for c in summary.checks:
        by[c["config"]].append(c)
    for config, cs in sorted(by.items(), key=lambda kv: A._config_order(kv[0])):
        bad = [c for c in cs if not c["match"]]
        lines.append(
            f"| {config} | {len(cs)} | {len(cs) - len(bad)} | {len(bad)} | {sum(1 for c in bad if c.get('near_tie'))} |"
        )
    bad = [c for c in summary.checks if not c["match"]]
    if bad:
        lines += [
            "",
            "| config | prompt | repeat | position | target-only token | other token | logit gap "
            "| top-2 margin | near-tie |",
            "|---" * 9 + "|",
        ]
        for c in bad:
            lines.append(
                f"| {c['config']} | {c['prompt_id']} | {c['repeat']} | {c['first_diff']} "
                f"| {c.get('expected_token', '–')} | {c.get('got_token', '–')} | {_n(c.get('logit_gap'), '.4f')} "
                f"| {_n(c.get('top2_margin'), '.4f')} | {c.get('near_tie', '–')} |"
            )
    return lines


# -- plots -------------------------------------------------------------------------------------------
def plot(summary: Summary, out_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samplings = summary.samplings() or ["-"]
    figs = {name: plt.subplots(1, len(samplings), figsize=(5.5 * len(samplings), 4), squeeze=False) for name in PLOTS}
    for i, sampling in enumerate(samplings):
        _plot_speedup_vs_k(figs["speedup_vs_k.png"][1][0][i], summary, sampling)
        _plot_positions(figs["acceptance_by_position.png"][1][0][i], summary, sampling)
        _plot_context(figs["speedup_vs_context.png"][1][0][i], summary, sampling)
        _plot_predicted(figs["predicted_vs_measured.png"][1][0][i], summary, sampling)
    for name, (fig, _) in figs.items():
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=100)
        plt.close(fig)


def _finish(ax, title: str, xlabel: str, ylabel: str) -> None:
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)


def _plot_speedup_vs_k(ax, summary: Summary, sampling: str) -> None:
    for group in summary.groups():
        cells = sorted(summary.spec_cells(sampling, group), key=lambda c: c.k)
        pts = [(c.k, c.speedup) for c in cells if c.speedup is not None]
        if pts:
            xs, ys = zip(*pts)
            ax.plot(xs, ys, marker="o", lw=2.5 if group == "overall" else 1.2, label=group)
    decode = [
        (c.k, c.decode_speedup)
        for c in sorted(summary.spec_cells(sampling), key=lambda c: c.k)
        if c.decode_speedup is not None
    ]
    if decode:
        xs, ys = zip(*decode)
        ax.plot(xs, ys, marker="s", ls="--", color="black", lw=1.2, label="overall, decode only")
    hf = summary.cell(sampling, "hf-assisted")
    if hf is not None and hf.speedup is not None:
        ax.axhline(hf.speedup, color="grey", ls=":", label="HF assisted (overall)")
    ax.axhline(1.0, color="black", lw=0.8)
    _finish(ax, f"speedup vs draft length ({sampling})", "draft length k", "speedup over target-only")


def _plot_positions(ax, summary: Summary, sampling: str) -> None:
    for c in sorted(summary.spec_cells(sampling), key=lambda c: c.k):
        pts = [(j + 1, v) for j, v in enumerate(c.acceptance_by_position) if v is not None]
        if pts:
            xs, ys = zip(*pts)
            ax.plot(xs, ys, marker="o", label=c.config)
    ax.set_ylim(0, 1.02)
    _finish(ax, f"acceptance by position ({sampling})", "draft position j", "acceptance rate")


def _plot_context(ax, summary: Summary, sampling: str) -> None:
    order = [label for _, _, label in A.BUCKETS]
    cells = [c for c in summary.context if c.sampling == sampling and c.config != A.TARGET and c.speedup is not None]
    present = [b for b in order if any(c.bucket == b for c in cells)]
    for config in dict.fromkeys(c.config for c in cells):
        pts = [(present.index(c.bucket), c.speedup) for c in cells if c.config == config]
        xs, ys = zip(*sorted(pts))
        ax.plot(xs, ys, marker="o", label=config)
    ax.set_xticks(range(len(present)), present)
    ax.axhline(1.0, color="black", lw=0.8)
    _finish(ax, f"decode speedup vs context ({sampling})", "context length (tokens)", "speedup over target-only")


def _plot_predicted(ax, summary: Summary, sampling: str) -> None:
    cells = [
        c
        for c in summary.cells
        if c.sampling == sampling and c.k > 0 and c.decode_speedup is not None and c.predicted_speedup is not None
    ]
    for group in dict.fromkeys(c.group for c in cells):
        mine = [c for c in cells if c.group == group]
        ax.scatter(
            [c.predicted_speedup for c in mine],
            [c.decode_speedup for c in mine],
            label=group,
            marker="*" if group == "overall" else "o",
            s=80 if group == "overall" else 25,
        )
        for c in mine:
            if group == "overall":
                ax.annotate(f"k={c.k}", (c.predicted_speedup, c.decode_speedup), fontsize=7)
    overall = [c for c in cells if c.group == "overall" and c.predicted_speedup_v is not None]
    if overall:
        ax.scatter(
            [c.predicted_speedup_v for c in overall],
            [c.decode_speedup for c in overall],
            facecolors="none",
            edgecolors="black",
            s=60,
            label="overall, predicted with measured v: E/(k·c+v)",
        )
    if cells:
        hi = max(max(c.predicted_speedup for c in cells), max(c.decode_speedup for c in cells)) * 1.1
        ax.plot([0, hi], [0, hi], color="black", lw=0.8, ls="--", label="measured = predicted")
    _finish(
        ax, f"predicted vs measured ({sampling})", "predicted speedup (filled: E/(k·c+1))", "measured decode speedup"
    )

"""Write a sweep to disk: ``requests.jsonl`` (raw, one line per request), ``summary.json``,
``report.md``, ``throughput.png`` and ``latency.png``."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from specdecode.load import stats
from specdecode.load.records import SweepResult
from specdecode.load.runner import LoadConfig
from specdecode.load.stats import Comparison, LevelSummary, Slo

_MARKER = "Definitions (also written into every report):"
DEFINITIONS = (stats.__doc__ or "").partition(_MARKER)[2].strip()


@dataclasses.dataclass
class Report:
    """Everything derived from one sweep."""

    summaries: dict[str, list[LevelSummary]]
    comparisons: list[Comparison]  # each candidate against the first endpoint (the baseline)

    @property
    def comparison(self) -> Comparison | None:
        """The first candidate's (with two endpoints, the only one)."""
        return self.comparisons[0] if self.comparisons else None


def build_report(result: SweepResult, slo: Slo) -> Report:
    summaries = {label: [stats.summarize(run, slo) for run in result.runs_for(label)] for label in result.labels}
    lists = list(summaries.values())
    comparisons = [stats.compare(lists[0], other) for other in lists[1:]]
    if result.labels:
        base = {run.level: run for run in result.runs_for(result.labels[0])}
        for comparison in comparisons:
            cand = {run.level: run for run in result.runs_for(comparison.candidate)}
            comparison.paired = [stats.paired(base[level], cand[level]) for level in comparison.levels]
    return Report(summaries, comparisons)


def write_outputs(result: SweepResult, config: LoadConfig, slo: Slo, out_dir: Path, prompt_set: str = "") -> Report:
    out_dir.mkdir(parents=True, exist_ok=True)
    report = build_report(result, slo)
    with (out_dir / "requests.jsonl").open("w", encoding="utf-8") as fh:
        for run in result.levels:
            for record in run.records:
                row = {
                    "endpoint": run.label,
                    "level": run.level,
                    "mode": run.mode,
                    **{k: v for k, v in dataclasses.asdict(record).items() if k != "text"},
                    "tpot_s": record.tpot_s,
                }
                fh.write(json.dumps(row) + "\n")
    summary = {
        "config": config_dict(config, slo, prompt_set),
        "endpoints": result.endpoints,
        "interrupted": result.interrupted,
        "skipped": [{"endpoint": label, "level": level} for label, level in result.skipped],
        "levels": [dataclasses.asdict(s) for runs in report.summaries.values() for s in runs],
        "comparison": dataclasses.asdict(report.comparison) if report.comparison else None,
        "comparisons": [dataclasses.asdict(c) for c in report.comparisons],
        "definitions": DEFINITIONS,
    }
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    (out_dir / "report.md").write_text(markdown(result, config, report), encoding="utf-8")
    plot(report, config.mode, out_dir)
    return report


def config_dict(config: LoadConfig, slo: Slo, prompt_set: str) -> dict[str, Any]:
    """The run's settings as JSON (never the API key)."""
    fields = (
        "mode",
        "levels",
        "num_requests",
        "rounds",
        "duration_s",
        "time_limit_s",
        "output_len",
        "request_timeout_s",
        "seed",
    )
    return {
        **{name: getattr(config, name) for name in fields},
        "prompt_set": prompt_set,
        "num_prompts": len(config.prompts),
        "extra_body": {t.label: t.extra_body for t in config.targets},
        "slo": dataclasses.asdict(slo),
    }


def level_name(mode: str) -> str:
    return "concurrency" if mode == "closed" else "request rate (req/s)"


def markdown(result: SweepResult, config: LoadConfig, report: Report) -> str:
    mode = "closed loop (fixed concurrency)" if config.mode == "closed" else "open loop (Poisson)"
    lines = [f"# Load test: {mode}", ""]
    if result.interrupted:
        lines += ["**Interrupted**: only the requests that finished are included.", ""]
    if result.skipped:
        skipped = ", ".join(f"{label}@{level:g}" for label, level in result.skipped)
        lines += [f"Skipped by the {config.time_limit_s:g} s time limit: {skipped}.", ""]
    rounds = (
        f", the endpoints alternating in {config.rounds} rounds of the level's requests"
        if config.rounds > 1 and len(result.endpoints) > 1
        else ""
    )
    lines += [
        f"{config.num_requests} requests and at most {config.duration_s:g} s per level{rounds}; "
        f"{len(config.prompts)} prompts; seed {config.seed}.",
        "",
        "| endpoint | url | model |",
        "|---|---|---|",
    ]
    lines += [f"| {label} | {e['url']} | {e['model']} |" for label, e in result.endpoints.items()]
    lines += ["", "## Results", "", *_results_table(report, level_name(config.mode))]
    lines += _server_table(report, level_name(config.mode))
    lines += _cache_table(report, level_name(config.mode))
    lines += _choices_table(report, level_name(config.mode))
    for comparison in report.comparisons:
        lines += ["", *_comparison_section(comparison, level_name(config.mode))]
    lines += ["", "## Definitions", "", DEFINITIONS, ""]
    return "\n".join(lines)


def _ms(dist: dict[str, float] | None) -> str:
    if dist is None:
        return "-"
    return " / ".join(f"{dist[q] * 1000:.1f}" for q in ("p50", "p90", "p99"))


def _interval(lo: float | None, hi: float | None) -> str:
    return "" if lo is None or hi is None else f" [{lo:.3f}, {hi:.3f}]"


def _num(value: float | None, fmt: str = ".2f") -> str:
    return "-" if value is None else format(value, fmt)


def _results_table(report: Report, level: str) -> list[str]:
    rows = [
        "Latencies are p50 / p90 / p99 in milliseconds; goodput is requests/s within the SLOs.",
        "",
        f"| endpoint | {level} | done | cancelled | errors | req/s | output tok/s | goodput "
        "| TTFT | TPOT | ITL | latency | acceptance | tok/step |",
        "|---" * 14 + "|",
    ]
    for summary in (s for runs in report.summaries.values() for s in runs):
        errors = ", ".join(f"{k}: {v}" for k, v in sorted(summary.errors.items())) or "0"
        spec = summary.speculation or {}
        rows.append(
            f"| {summary.label} | {summary.level:g} | {summary.completed} | {summary.cancelled} "
            f"| {errors} | {_num(summary.request_throughput)} "
            f"| {_num(summary.output_throughput, '.1f')} | {_num(summary.goodput)} "
            f"| {_ms(summary.ttft)} | {_ms(summary.tpot)} | {_ms(summary.itl)} "
            f"| {_ms(summary.latency)} | {_num(spec.get('acceptance_rate'), '.3f')} "
            f"| {_num(spec.get('tokens_per_step'))} |"
        )
    return rows


def _choices_table(report: Report, level: str) -> list[str]:
    """What a server's ``--draft-policy auto`` chose (share of target steps), where it reports it."""
    summaries = [s for runs in report.summaries.values() for s in runs if (s.speculation or {}).get("choices")]
    if not summaries:
        return []
    rows = [
        "",
        "Draft choices reported by the server (`--draft-policy auto`; share of target steps):",
        "",
        f"| endpoint | {level} | choices |",
        "|---" * 3 + "|",
    ]
    for s in summaries:
        counts = s.speculation["choices"]
        total = sum(counts.values()) or 1
        top = sorted(counts.items(), key=lambda kv: -kv[1])[:8]
        rows.append(f"| {s.label} | {s.level:g} | " + ", ".join(f"{k} {n / total:.0%}" for k, n in top) + " |")
    return rows


def _server_table(report: Report, level: str) -> list[str]:
    """The server's own queue / prefill / first-token times, where it reports them (specdecode serve)."""
    summaries = [s for runs in report.summaries.values() for s in runs if s.server_ttft is not None]
    if not summaries:
        return []
    rows = [
        "",
        "Server-side times (from the usage extension; p50 / p90 / p99 in milliseconds, from arrival at the server):",
        "",
        f"| endpoint | {level} | queue | prefill | TTFT |",
        "|---" * 5 + "|",
    ]
    rows += [
        f"| {s.label} | {s.level:g} | {_ms(s.server_queue)} | {_ms(s.server_prefill)} | {_ms(s.server_ttft)} |"
        for s in summaries
    ]
    return rows


def _cache_table(report: Report, level: str) -> list[str]:
    """The share of prompt tokens the server's prefix cache answered, where it says (OpenAI's
    ``usage.prompt_tokens_details.cached_tokens``, llama-server's ``timings.cache_n``)."""
    summaries = [s for runs in report.summaries.values() for s in runs if s.cached_share is not None]
    if not summaries:
        return []
    rows = ["", "Prompt tokens answered by the server's prefix cache:", "", f"| endpoint | {level} | cached share |"]
    rows += ["|---" * 3 + "|"] + [f"| {s.label} | {s.level:g} | {s.cached_share:.1%} |" for s in summaries]
    return rows


def _comparison_section(comparison: Comparison, level: str) -> list[str]:
    names = [(name, label) for name, label, _ in stats.RATIO_METRICS]
    lines = [
        f"## {comparison.candidate} / {comparison.baseline}",
        "",
        "Ratios above 1.0 mean the candidate is higher (better for throughput, worse for latency).",
        "",
        f"| {level} | " + " | ".join(label for _, label in names) + " |",
        "|---" * (len(names) + 1) + "|",
    ]
    for i, lvl in enumerate(comparison.levels):
        cells = " | ".join(_num(comparison.ratios[name][i], ".3f") for name, _ in names)
        lines.append(f"| {lvl:g} | {cells} |")
    if comparison.paired:
        lines += [
            "",
            "Paired by request (request i of both is the same prompt; median over the pairs of "
            "candidate / baseline, [95 % interval of that median]):",
            "",
            f"| {level} | pairs | TTFT | TPOT | latency |",
            "|---|---|---|---|---|",
        ]
        for lvl, pair in zip(comparison.levels, comparison.paired):
            lines.append(
                f"| {lvl:g} | {int(pair['n'] or 0)} | "
                + " | ".join(
                    _num(pair[name], ".3f") + _interval(pair.get(f"{name}_lo"), pair.get(f"{name}_hi"))
                    for name, _ in stats.PAIRED_METRICS
                )
                + " |"
            )
    lines += ["", "Crossover (first level where the ratio flips past 1.0):", ""]
    for name, label in names:
        point = comparison.crossover[name]
        where = "no crossover in the tested range" if point is None else f"at {level} {point:g}"
        lines.append(f"- {label}: {where}")
    return lines


def plot(report: Report, mode: str, out_dir: Path) -> None:
    """``throughput.png`` and ``latency.png`` (p50 solid, p99 dashed), one colour per endpoint."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = {
        "throughput": [("output_throughput", "output tokens/s"), ("request_throughput", "requests/s")],
        "latency": [("ttft", "TTFT (s)"), ("tpot", "TPOT (s)"), ("latency", "latency (s)")],
    }
    for name, metrics in panels.items():
        fig, axes = plt.subplots(1, len(metrics), figsize=(5 * len(metrics), 4), squeeze=False)
        for ax, (metric, ylabel) in zip(axes[0], metrics):
            for i, (label, runs) in enumerate(report.summaries.items()):
                _plot_metric(ax, runs, metric, label, f"C{i}", distribution=name == "latency")
            ax.set_xlabel(level_name(mode))
            ax.set_ylabel(ylabel)
            if mode == "closed":
                ax.set_xscale("log", base=2)
                ax.minorticks_off()
            levels = sorted({s.level for runs in report.summaries.values() for s in runs})
            ax.set_xticks(levels, [f"{x:g}" for x in levels])
            ax.grid(alpha=0.3)
            if ax.lines:
                ax.legend()
        fig.tight_layout()
        fig.savefig(out_dir / f"{name}.png", dpi=100)
        plt.close(fig)


def _plot_metric(ax: Any, runs: list[LevelSummary], metric: str, label: str, color: str, distribution: bool) -> None:
    keys = [("p50", "-"), ("p99", "--")] if distribution else [("", "-")]
    for key, style in keys:
        name = f"{metric}.{key}" if key else metric
        points = [(s.level, v) for s in runs if (v := s.metric(name)) is not None]
        if points:
            xs, ys = zip(*points)
            ax.plot(xs, ys, style, marker="o", color=color, label=f"{label} {key}".strip())

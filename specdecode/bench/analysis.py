"""Benchmark arithmetic: pure functions over run records, no models, no I/O.

Definitions (also written into every report):

* **tok/s** of a run = generated tokens / wall time of the whole request (prefill included). A
  prompt's tok/s is the median over its repeats; a set's tok/s is total tokens / total time of its
  prompts (each prompt at its median), so long prompts weigh by their time.
* **speedup** = tok/s of a configuration / tok/s of this engine's target-only decoding under the same
  sampling setting, on the same prompts.
* **acceptance rate** = accepted / drafted draft tokens (the toolkit convention, `specdecode.metrics`).
* **α** (Leviathan et al.'s per-token acceptance probability) is estimated from the same steps as
  accepted / (accepted + rejections), where a rejection is a step that accepted fewer tokens than it
  drafted: the maximum-likelihood estimate when each draft token is accepted independently with
  probability α. (accepted / drafted is biased low: with k = 4 and α = 0.8 it is 0.59.)
* **tokens per step** = emitted tokens / target steps, including the bonus token.
* **c** (draft/target cost ratio) = (draft time per drafted token) / (target time of one
  target-only decode step): the engine's `draft_s` in the speculative runs over the tokens drafted
  (one draft forward per drafted token), and its `verify_s` (target forward + token choice) in the
  target-only runs of the same prompts over their steps.
* **v** (verification cost ratio) = target time of one speculative step (verify k + 1 tokens and
  the acceptance test) / target time of one target-only step. Leviathan et al. assume v = 1.
* **decode speedup** = the same ratio over decode steps only (emitted tokens / step wall time,
  prefill excluded), which is what the formula below describes.
* **predicted speedup** (Leviathan et al. 2023, eq. 1 and thm. 3.8) = E / (k·c + 1) with
  E = (1 − α^(k+1)) / (1 − α) the expected tokens per step; measured decode speedup / predicted < 1
  is overhead the formula does not model (v > 1, Python, sampling, bookkeeping).
* **predicted from the steps** = mean over steps of E(α, n) / (mean n · c + v), n each step's drafted length:
  the same formula for a drafter that drafts fewer than k tokens in some steps (a lookup without a match
  drafts none, and such a step emits one token); measured decode speedup / this is the share of the
  speculative step's time that the measured draft and verify costs account for (1: the engine adds nothing).
* **break-even α** for k and c: the α at which E(α, k) = k·c + 1, i.e. drafting just pays for
  itself; with the measured v in place of 1 it is the *overhead-aware* break-even.
* **tokens per step needed** (per prompt) = the decode step's wall time with speculation / target-only's
  (draft, verify and bookkeeping together): speculation pays exactly when tokens per step got exceeds it
  (decode speedup = got / needed). It holds for any drafter (lookup, auto, trees), with no model of α.
* **latency** of a request = its wall time, prefill included: the time to the last token (a short
  completion's latency is what an editor waits for). p50 / p99 over every run of a group (all
  repeats); the ratio is to target-only's over the runs of the same prompts.
* **latency after prefill** = the same less the prompt's prefill (target's, and a draft model's that
  reads the prompt up front): the time from the end of prefill to the last token, what a request costs
  when its prompt is already cached (an editor resending its context to a prompt-caching server). A
  drafter that reads the prompt later (`auto`'s draft model, catching up) pays that reading inside it.
* **context length** of a step = prompt + tokens generated before the step; per-bucket tok/s is
  emitted tokens / decode step time (prefill excluded).
"""

from __future__ import annotations

import math
import re
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Iterable

_MARKER = "Definitions (also written into every report):"
DEFINITIONS = (__doc__ or "").partition(_MARKER)[2].strip()

BUCKETS: tuple[tuple[int, float, str], ...] = (
    (0, 256, "<256"),
    (256, 512, "256–512"),
    (512, 1024, "512–1k"),
    (1024, 2048, "1k–2k"),
    (2048, math.inf, "≥2k"),
)
TARGET = "target"  # the config every speedup is relative to


# -- the formula -----------------------------------------------------------------------------------
def expected_tokens_per_step(alpha: float, k: int) -> float:
    """E = (1 − α^(k+1)) / (1 − α): expected tokens a step emits (bonus included) with k drafts."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    if alpha == 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def predicted_speedup(alpha: float, k: int, c: float, v: float = 1.0) -> float:
    """Leviathan et al.'s walltime improvement E / (k·c + v) (v = 1 in the paper)."""
    return expected_tokens_per_step(alpha, k) / (k * c + v)


def predicted_from_steps(alpha: float, lengths: dict[int, int], c: float, v: float) -> float | None:
    """The formula over the steps as drafted: mean E(α, n) / (mean n · c + v), ``lengths`` counting the steps
    by their drafted length n (a step drafting none emits one token and costs one target step)."""
    steps = sum(lengths.values())
    if not steps:
        return None
    tokens = sum(expected_tokens_per_step(alpha, n) * s for n, s in lengths.items()) / steps
    drafted = sum(n * s for n, s in lengths.items()) / steps
    return tokens / (drafted * c + v)


def break_even_alpha(k: int, c: float, v: float = 1.0, tol: float = 1e-10) -> float | None:
    """The α where E(α, k) = k·c + v; ``None`` when even α = 1 does not pay (k·c + v ≥ k + 1).

    E rises monotonically from 1 (α = 0) to k + 1 (α = 1), so bisection finds the unique root.
    """
    if k < 1:
        raise ValueError("break-even needs k >= 1")
    cost = k * c + v
    if cost <= 1.0:
        return 0.0
    if cost >= k + 1:
        return None
    lo, hi = 0.0, 1.0
    while hi - lo > tol:
        mid = (lo + hi) / 2
        if expected_tokens_per_step(mid, k) < cost:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def alpha_estimate(accepted: int, rejections: int) -> float | None:
    """MLE of the per-token acceptance probability from accepted tokens and rejecting steps."""
    trials = accepted + rejections
    return accepted / trials if trials else None


def bucket_of(context_len: int) -> str:
    for lo, hi, label in BUCKETS:
        if lo <= context_len < hi:
            return label
    raise ValueError(f"negative context length {context_len}")


# -- counters pooled over runs ---------------------------------------------------------------------
@dataclass
class Counts:
    """Decode counters summed over runs (and their steps)."""

    runs: int = 0
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    rejections: int = 0
    emitted: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    step_s: float = 0.0  # wall time of the decode steps (draft + verify + bookkeeping)
    nodes: int = 0  # draft tokens verified (trees: every node; chains: = drafted)
    lengths: dict[int, int] = field(default_factory=dict)  # steps by their drafted length
    drafted_at: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)

    def add_run(self, rec: dict[str, Any]) -> None:
        stats, steps = rec.get("stats"), rec.get("steps")
        if stats is None or steps is None:
            return
        self.runs += 1
        self.draft_s += stats["draft_s"]
        self.verify_s += stats["verify_s"]
        self.drafted_at = _add_lists(self.drafted_at, stats["drafted_at"])
        self.accepted_at = _add_lists(self.accepted_at, stats["accepted_at"])
        for step in steps:
            self.add_step(step)

    def add_step(self, step: list) -> None:
        _, emitted, drafted, accepted, seconds = step[:5]
        self.nodes += step[5] if len(step) > 5 else drafted  # records before trees: nodes == drafted
        self.steps += 1
        self.lengths[drafted] = self.lengths.get(drafted, 0) + 1
        self.emitted += emitted
        self.drafted += drafted
        self.accepted += accepted
        self.rejections += int(accepted < drafted)
        self.step_s += seconds

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def alpha(self) -> float | None:
        return alpha_estimate(self.accepted, self.rejections)

    @property
    def tokens_per_step(self) -> float | None:
        return self.emitted / self.steps if self.steps else None

    @property
    def acceptance_by_position(self) -> list[float | None]:
        return [a / d if d else None for a, d in zip(self.accepted_at, self.drafted_at)]

    @property
    def draft_s_per_token(self) -> float | None:
        return self.draft_s / self.drafted if self.drafted else None

    @property
    def verify_s_per_step(self) -> float | None:
        return self.verify_s / self.steps if self.steps else None


def _add_lists(a: list[int], b: list[int]) -> list[int]:
    n = max(len(a), len(b))
    return [x + y for x, y in zip(a + [0] * (n - len(a)), b + [0] * (n - len(b)))]


# -- summaries ---------------------------------------------------------------------------------------
@dataclass
class Cell:
    """One (sampling, config) over one group of prompts (a category or "overall")."""

    sampling: str
    config: str
    group: str
    k: int
    n_prompts: int
    tokens: float
    seconds: float
    tok_s: float
    speedup: float | None = None
    decode_tok_s: float | None = None  # emitted / decode step time (prefill excluded), engine configs only
    decode_speedup: float | None = None
    acceptance_rate: float | None = None
    alpha: float | None = None
    tokens_per_step: float | None = None
    expected_tokens_per_step: float | None = None
    acceptance_by_position: list[float | None] = field(default_factory=list)
    c: float | None = None
    v: float | None = None
    predicted_speedup: float | None = None
    predicted_speedup_v: float | None = None  # E / (k·c + v)
    efficiency: float | None = None  # measured decode speedup / predicted speedup
    predicted_speedup_steps: float | None = None  # mean E(α, n) / (mean n · c + v) over the steps' drafted lengths
    efficiency_steps: float | None = None  # measured decode speedup / predicted from the steps
    nodes_per_step: float | None = None  # draft tokens verified per step (trees: v is v(nodes))


def runs_of(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in records if r.get("type") == "run"]


def per_prompt(records: Iterable[dict[str, Any]]) -> dict[tuple[str, str, str], dict[str, Any]]:
    """(sampling, config, prompt_id) -> median tok/s over repeats, tokens, category, counts."""
    grouped: dict[tuple[str, str, str], list[dict[str, Any]]] = defaultdict(list)
    for r in runs_of(records):
        grouped[(r["sampling"], r["config"], r["prompt_id"])].append(r)
    out = {}
    for key, runs in grouped.items():
        counts = Counts()
        for r in runs:
            counts.add_run(r)
        tok_s = statistics.median(r["new_tokens"] / r["wall_s"] for r in runs)
        tokens = statistics.median(r["new_tokens"] for r in runs)
        out[key] = {
            "tok_s": tok_s,
            "tokens": tokens,
            "seconds": tokens / tok_s,
            "repeats": len(runs),
            "category": runs[0]["category"],
            "k": runs[0]["k"],
            "counts": counts,
            "latency_s": statistics.median(r["wall_s"] for r in runs),
        }
    return out


def prompt_rows(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (sampling, config, prompt): median tok/s, speedup over target-only, acceptance, α, tokens/step."""
    prompts = per_prompt(records)
    rows = []
    for (sampling, config, pid), p in sorted(
        prompts.items(), key=lambda kv: (kv[0][0], kv[0][2], _config_order(kv[0][1]))
    ):
        base, counts = prompts.get((sampling, TARGET, pid)), p["counts"]
        rows.append(
            {
                "sampling": sampling,
                "config": config,
                "prompt_id": pid,
                "category": p["category"],
                "k": p["k"],
                "repeats": p["repeats"],
                "tokens": p["tokens"],
                "tok_s": p["tok_s"],
                "speedup": p["tok_s"] / base["tok_s"] if base else None,
                "acceptance_rate": counts.acceptance_rate if p["k"] else None,
                "alpha": counts.alpha if p["k"] else None,
                "tokens_per_step": counts.tokens_per_step if p["k"] else None,
            }
        )
    return rows


def summarize(records: list[dict[str, Any]], group_by_category: bool = True) -> list[Cell]:
    """Cells for every (sampling, config) over each category and over all prompts."""
    prompts = per_prompt(records)
    groups: dict[str, set[str]] = defaultdict(set)
    for (_, _, pid), p in prompts.items():
        groups["overall"].add(pid)
        if group_by_category:
            groups[p["category"]].add(pid)
    if len(groups) == 2:  # one category: it is the overall
        groups = {"overall": groups["overall"]}
    cells = []
    for sampling, config in sorted({(s, c) for s, c, _ in prompts}, key=lambda sc: (sc[0], _config_order(sc[1]))):
        for group, pids in groups.items():
            cell = _cell(prompts, sampling, config, group, pids)
            if cell is not None:
                cells.append(cell)
    return cells


def _cell(prompts: dict, sampling: str, config: str, group: str, pids: set[str]) -> Cell | None:
    mine = {pid: prompts[(sampling, config, pid)] for pid in pids if (sampling, config, pid) in prompts}
    if not mine:
        return None
    base = {pid: prompts[(sampling, TARGET, pid)] for pid in mine if (sampling, TARGET, pid) in prompts}
    tokens = sum(p["tokens"] for p in mine.values())
    seconds = sum(p["seconds"] for p in mine.values())
    k = next(iter(mine.values()))["k"]
    cell = Cell(sampling, config, group, k, len(mine), tokens, seconds, tokens / seconds)
    if base and set(base) == set(mine):
        cell.speedup = cell.tok_s / (sum(p["tokens"] for p in base.values()) / sum(p["seconds"] for p in base.values()))
    counts, base_counts = Counts(), Counts()
    for pid, p in mine.items():
        _merge(counts, p["counts"])
        if pid in base:
            _merge(base_counts, base[pid]["counts"])
    fill_speculation(cell, counts, base_counts)
    return cell


def fill_speculation(cell: Cell, counts: Counts, base_counts: Counts) -> None:
    """Decode rate; for a speculative cell (k ≥ 1) also acceptance, α, c, v and the predicted speedup."""
    if counts.step_s:
        cell.decode_tok_s = counts.emitted / counts.step_s
        if base_counts.step_s:
            cell.decode_speedup = cell.decode_tok_s / (base_counts.emitted / base_counts.step_s)
    if cell.k < 1 or not counts.steps:
        return
    cell.acceptance_rate = counts.acceptance_rate
    cell.alpha = counts.alpha
    cell.tokens_per_step = counts.tokens_per_step
    cell.acceptance_by_position = counts.acceptance_by_position
    if cell.alpha is not None:
        cell.expected_tokens_per_step = expected_tokens_per_step(cell.alpha, cell.k)
    target_step = base_counts.verify_s_per_step
    if target_step and counts.draft_s_per_token is not None:
        cell.c = counts.draft_s_per_token / target_step
        cell.v = counts.verify_s_per_step / target_step
    cell.nodes_per_step = counts.nodes / counts.steps
    if is_tree(cell.config):  # the chain formulas do not describe a tree: measured figures only
        return
    if cell.alpha is not None and cell.c is not None:
        cell.predicted_speedup = predicted_speedup(cell.alpha, cell.k, cell.c)
        cell.predicted_speedup_v = predicted_speedup(cell.alpha, cell.k, cell.c, cell.v)
        if cell.decode_speedup is not None:
            cell.efficiency = cell.decode_speedup / cell.predicted_speedup
        if cell.v is not None:
            cell.predicted_speedup_steps = predicted_from_steps(cell.alpha, counts.lengths, cell.c, cell.v)
            if cell.decode_speedup is not None and cell.predicted_speedup_steps:
                cell.efficiency_steps = cell.decode_speedup / cell.predicted_speedup_steps


def _merge(into: Counts, other: Counts) -> None:
    for name in (
        "runs",
        "steps",
        "drafted",
        "accepted",
        "rejections",
        "emitted",
        "draft_s",
        "verify_s",
        "step_s",
        "nodes",
    ):
        setattr(into, name, getattr(into, name) + getattr(other, name))
    into.drafted_at = _add_lists(into.drafted_at, other.drafted_at)
    into.accepted_at = _add_lists(into.accepted_at, other.accepted_at)
    for n, steps in other.lengths.items():
        into.lengths[n] = into.lengths.get(n, 0) + steps


_SPEC_RE = re.compile(r"spec-k(\d+)(?:-t(\d+)n(\d+))?(?:@(\w+))?(?:\[([\w.-]+)\])?")  # [label]: --extra-draft
_QUANT_ORDER = {None: 0, "int8": 1, "int4": 2, "auto": 3}


def is_tree(config: str) -> bool:
    m = _SPEC_RE.fullmatch(config)
    return bool(m and m[2])


def _config_order(name: str) -> tuple[int, int, int, int, int, str]:
    if name == TARGET:
        return (0, 0, 0, 0, 0, name)
    m = _SPEC_RE.fullmatch(name)
    if m:
        return (1, int(m[1]), _QUANT_ORDER.get(m[4], 9) + (10 if m[5] else 0), int(m[2] or 0), int(m[3] or 0), name)
    return (2, 0, 0, 0, 0, name)


# -- context-length buckets --------------------------------------------------------------------------
@dataclass
class BucketCell:
    sampling: str
    config: str
    bucket: str
    steps: int
    tokens: int
    tok_s: float
    speedup: float | None
    acceptance_rate: float | None
    alpha: float | None


def by_context(records: list[dict[str, Any]]) -> list[BucketCell]:
    """Decode tok/s per context-length bucket (steps pooled over prompts and repeats)."""
    counts: dict[tuple[str, str, str], Counts] = defaultdict(Counts)
    for r in runs_of(records):
        for step in r.get("steps") or []:
            counts[(r["sampling"], r["config"], bucket_of(step[0]))].add_step(step)
    order = {label: i for i, (_, _, label) in enumerate(BUCKETS)}
    cells = []
    for (sampling, config, bucket), c in sorted(
        counts.items(), key=lambda kv: (kv[0][0], _config_order(kv[0][1]), order[kv[0][2]])
    ):
        if not c.step_s:
            continue
        base = counts.get((sampling, TARGET, bucket))
        rate = c.emitted / c.step_s
        base_rate = base.emitted / base.step_s if base and base.step_s else None
        cells.append(
            BucketCell(
                sampling,
                config,
                bucket,
                c.steps,
                c.emitted,
                rate,
                rate / base_rate if base_rate else None,
                c.acceptance_rate,
                c.alpha,
            )
        )
    return cells


# -- latency -----------------------------------------------------------------------------------------
def percentile(xs: Iterable[float], q: float) -> float | None:
    """The q-th percentile (0–100) by linear interpolation between order statistics (numpy's default)."""
    xs = sorted(xs)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass
class LatencyCell:
    """Time to the last token (request wall time, prefill included) of one (sampling, config, group)."""

    sampling: str
    config: str
    group: str
    requests: int
    p50_s: float
    p99_s: float
    p50_ratio: float | None = None  # / target-only's p50 over the runs of the same prompts
    p99_ratio: float | None = None


def latency_cells(
    records: list[dict[str, Any]], group_by_category: bool = True, after_prefill: bool = False
) -> list[LatencyCell]:
    """p50 / p99 request latency for every (sampling, config) over each category and over all prompts;
    ``after_prefill``: the latency after prefill (runs that time no prefill, the ``hf`` baselines, left out)."""
    walls: dict[tuple[str, str], dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    categories: dict[str, str] = {}
    for r in runs_of(records):
        if after_prefill and r.get("prefill_s") is None:
            continue
        wall = r["wall_s"] - r["prefill_s"] if after_prefill else r["wall_s"]
        walls[(r["sampling"], r["config"])][r["prompt_id"]].append(wall)
        categories[r["prompt_id"]] = r["category"]
    groups: dict[str, set[str]] = {"overall": set(categories)}
    if group_by_category and len(set(categories.values())) > 1:
        for pid, cat in categories.items():
            groups.setdefault(cat, set()).add(pid)
    cells = []
    for (sampling, config), by_prompt in sorted(walls.items(), key=lambda kv: (kv[0][0], _config_order(kv[0][1]))):
        base = walls.get((sampling, TARGET), {})
        for group, pids in groups.items():
            mine = [w for pid in pids & set(by_prompt) for w in by_prompt[pid]]
            if not mine:
                continue
            cell = LatencyCell(sampling, config, group, len(mine), percentile(mine, 50), percentile(mine, 99))
            shared = pids & set(by_prompt) & set(base)
            if shared:
                theirs = [w for pid in shared for w in base[pid]]
                ours = [w for pid in shared for w in by_prompt[pid]]
                cell.p50_ratio = percentile(ours, 50) / percentile(theirs, 50)
                cell.p99_ratio = percentile(ours, 99) / percentile(theirs, 99)
            cells.append(cell)
    return cells


# -- break-even --------------------------------------------------------------------------------------
@dataclass
class BreakEven:
    sampling: str
    config: str
    k: int
    prompt_id: str
    alpha: float | None
    acceptance_rate: float | None
    c: float | None
    v: float | None
    break_even: float | None  # formula (v = 1); None = never pays
    break_even_v: float | None  # with the measured v
    speedup: float | None
    tokens_per_step: float | None = None  # got
    needed_tokens_per_step: float | None = None  # step wall time / target-only's: pays iff got > needed
    latency_s: float | None = None  # time to the last token, median over repeats
    latency_ratio: float | None = None  # / target-only's for the same prompt

    @property
    def pays(self) -> bool | None:
        """Whether the decode steps paid for themselves (tokens per step got > needed)."""
        if self.tokens_per_step is None or self.needed_tokens_per_step is None:
            return None
        return self.tokens_per_step > self.needed_tokens_per_step

    @property
    def below(self) -> bool | None:
        """Below the formula's break-even (``None`` when not measurable, or for a tree)."""
        if self.alpha is None or self.c is None or is_tree(self.config):
            return None
        return self.break_even is None or self.alpha < self.break_even


def break_even_table(records: list[dict[str, Any]], category: str | None = None) -> list[BreakEven]:
    """Per prompt and speculative config: measured α, c, v, the break-even α, tokens per step needed
    and got, latency and the speedup. Trees get the drafter-agnostic columns only (no chain formula)."""
    prompts = per_prompt(records)
    rows = []
    for (sampling, config, pid), p in sorted(
        prompts.items(), key=lambda kv: (kv[0][0], _config_order(kv[0][1]), kv[0][2])
    ):
        if p["k"] < 1 or (category is not None and p["category"] != category):
            continue
        base = prompts.get((sampling, TARGET, pid))
        cell = Cell(sampling, config, pid, p["k"], 1, p["tokens"], p["seconds"], p["tok_s"])
        fill_speculation(cell, p["counts"], base["counts"] if base else Counts())
        be = be_v = None
        if cell.c is not None and not is_tree(config):
            be = break_even_alpha(cell.k, cell.c)
            be_v = break_even_alpha(cell.k, cell.c, cell.v)
        counts, base_counts = p["counts"], base["counts"] if base else Counts()
        needed = None
        if counts.steps and base_counts.steps and base_counts.step_s:
            needed = (counts.step_s / counts.steps) / (base_counts.step_s / base_counts.steps)
        rows.append(
            BreakEven(
                sampling,
                config,
                cell.k,
                pid,
                cell.alpha,
                cell.acceptance_rate,
                cell.c,
                cell.v,
                be,
                be_v,
                p["tok_s"] / base["tok_s"] if base else None,
                counts.tokens_per_step,
                needed,
                p["latency_s"],
                p["latency_s"] / base["latency_s"] if base else None,
            )
        )
    return rows


# -- greedy exactness ------------------------------------------------------------------------------
def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first position where ``a`` and ``b`` differ (or one ends); None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def is_near_tie(margin: float, top_logit: float, eps: float) -> bool:
    """A logit gap within two rounding units (``eps`` = the dtype's machine epsilon) of the logit's
    magnitude: different but equally valid execution orders can flip such a choice."""
    return margin <= 2 * eps * max(abs(top_logit), 1.0)


def median(xs: Iterable[float]) -> float | None:
    xs = list(xs)
    return statistics.median(xs) if xs else None

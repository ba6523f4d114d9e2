"""What a machine's cost profile holds, and the arithmetic of speculation on it, as pure functions of plain data.

A speculative step that drafts ``k`` tokens costs ``v(k + 1) + k * c`` target steps: one target forward of
the pending token and the ``k`` drafts (``v(n) = time(one forward of n tokens) / time(1)``, logits for every
row as verify needs them) and ``k`` draft steps (``c = draft step / target step``). It emits between 1 and
``k + 1`` tokens, so

* it pays when the mean tokens per step exceeds ``break_even(k) = v(k + 1) + k * c``;
* with every draft accepted the speedup is at most ``(k + 1) / (v(k + 1) + k * c)``: the ceiling of exact
  speculation at ``k`` (for a drafter that costs nothing, ``c = 0``: an n-gram or suffix lookup);
* with a fit ``time(n) = a + b * n`` over the measured widths, no draft length does better than
  ``time(1) / b``: the limit as ``k`` grows, every draft accepted (what ``verify_bound.py`` printed from a
  bench run's steps, now from direct measurements);
* with acceptance ``alpha`` per token (independent, as in Leviathan et al.) a step emits
  ``(1 - alpha ** (k + 1)) / (1 - alpha)`` tokens on average, so ``break_even_alpha`` is the acceptance a
  drafter needs at ``k`` to pay at all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

FORMAT = 1  # the JSON layout's version: a cached profile of another format is measured again
CONTEXT = 256  # tokens already cached before each timed forward (a realistic decode position)


# the CPU flags that decide which kernels run (printed beside every number)
SIMD_FLAGS = (
    "sse4_2",
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512cd",
    "avx512dq",
    "avx512vl",
    "avx512_bf16",
    "avx512_vnni",
    "avx512_vbmi",
    "avx_vnni",
    "amx_tile",
    "amx_int8",
    "amx_bf16",
    "asimd",
    "asimddp",
    "sve",
    "sve2",
    "i8mm",
    "bf16",
)


@dataclass(frozen=True)
class Machine:
    """The CPU a profile was measured on: its model name and its flags (all of them: the cache key)."""

    cpu: str
    flags: tuple[str, ...] = ()

    def simd(self) -> str:
        """The flags that decide which kernels run (printed beside every number)."""
        kept = [f for f in SIMD_FLAGS if f in self.flags]
        return " ".join(kept) or "none of the SIMD flags the kernels use"


@dataclass(frozen=True)
class ModelCost:
    """One model's measured forwards on one backend, after ``Profile.context`` tokens of context: medians
    over ``repeats`` rounds, in seconds, by the number of tokens ``n`` in the forward."""

    spec: str  # what the user named
    fingerprint: str  # the spec with the size and modification time of its files: other weights, other key
    description: str  # the runner's own words (backend, quantization, threads)
    step_s: dict[int, float]  # n -> one forward of n tokens with every row's logits (what verify runs)
    layers_s: dict[int, float] = field(default_factory=dict)  # n -> the same without the output layer
    repeats: int = 0

    @property
    def tok_s(self) -> float:
        """One-token decode speed: tokens per second of one-token steps."""
        return 1.0 / self.step_s[1]

    def v(self, n: int) -> float:
        return self.step_s[n] / self.step_s[1]

    def output_share(self, n: int) -> float | None:
        """The share of a forward of ``n`` tokens that the output layer takes (None where not measured)."""
        if n not in self.layers_s:
            return None
        return max(0.0, self.step_s[n] - self.layers_s[n]) / self.step_s[n]

    def to_json(self) -> dict:
        return {
            "spec": self.spec,
            "fingerprint": self.fingerprint,
            "description": self.description,
            "step_s": {str(n): s for n, s in self.step_s.items()},
            "layers_s": {str(n): s for n, s in self.layers_s.items()},
            "repeats": self.repeats,
        }

    @staticmethod
    def from_json(data: dict) -> ModelCost:
        return ModelCost(
            data["spec"],
            data["fingerprint"],
            data.get("description", ""),
            {int(n): float(s) for n, s in data["step_s"].items()},
            {int(n): float(s) for n, s in data.get("layers_s", {}).items()},
            int(data.get("repeats", 0)),
        )


def tokens_per_step(alpha: float, k: int) -> float:
    """Mean tokens a step of ``k`` drafts emits when each draft is accepted with probability ``alpha``
    (until the first rejection; the bonus or corrected token included)."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def break_even(v: dict[int, float], k: int, c: float = 0.0) -> float:
    """Tokens per step that a step of ``k`` drafts must emit to beat target-only decoding."""
    return v[k + 1] + k * c


def ceiling(v: dict[int, float], k: int, c: float = 0.0) -> float:
    """The speedup of ``k`` drafts per step when every draft is accepted."""
    return (k + 1) / break_even(v, k, c)


def best_k(v: dict[int, float], c: float = 0.0) -> tuple[int, float]:
    """The draft length with the highest ceiling, and that ceiling."""
    ks = [n - 1 for n in sorted(v) if n >= 2]
    k = max(ks, key=lambda k: ceiling(v, k, c))
    return k, ceiling(v, k, c)


def max_draft_cost(v: dict[int, float], k: int, tokens: float | None = None) -> float:
    """The dearest drafter (``c``) that still breaks even at ``k`` when its steps emit ``tokens`` tokens
    (default ``k + 1``: every draft accepted); negative when not even a free one does."""
    tokens = float(k + 1) if tokens is None else tokens
    return (tokens - v[k + 1]) / k


def break_even_alpha(v: dict[int, float], k: int, c: float = 0.0) -> float | None:
    """The acceptance per token a drafter of cost ``c`` needs at ``k`` to pay (None: no acceptance can)."""
    need = break_even(v, k, c)
    if need >= k + 1:
        return None
    if need <= 1.0:
        return 0.0
    lo, hi = 0.0, 1.0
    for _ in range(60):  # tokens_per_step rises with alpha: bisection
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if tokens_per_step(mid, k) < need else (lo, mid)
    return (lo + hi) / 2


def linear_fit(v: dict[int, float]) -> tuple[float, float]:
    """Least squares ``v(n) ~ a + b * n`` over the measured widths (every width weighs the same)."""
    ns = sorted(v)
    mean_n = sum(ns) / len(ns)
    mean_v = sum(v[n] for n in ns) / len(ns)
    var = sum((n - mean_n) ** 2 for n in ns)
    b = sum((n - mean_n) * (v[n] - mean_v) for n in ns) / var if var else 0.0
    return mean_v - b * mean_n, b


def limit(v: dict[int, float]) -> float:
    """``time(1) / b``: the most any draft length gains, every draft accepted (inf where the fit is flat)."""
    _, b = linear_fit(v)
    return 1.0 / b if b > 0 else math.inf


@dataclass(frozen=True)
class Profile:
    """The cost profile of one target (and its drafts) on one backend, machine and thread count."""

    backend: str
    threads: int
    machine: Machine
    context: int  # tokens in the cache before each timed forward
    target: ModelCost
    drafts: dict[str, ModelCost] = field(default_factory=dict)  # spec -> its cost, same backend
    others_cpu: float = 0.0  # share of all CPUs other processes used while it was measured
    spread: float = 1.0  # median over measured cells of (median repeat / fastest repeat)
    measured_s: float = 0.0  # how long measuring took (loads excluded)
    created: str = ""  # when (UTC, ISO 8601)
    key: str = ""  # what it was measured for (specdecode.profile.cache)

    @property
    def v(self) -> dict[int, float]:
        """``v(n)`` of the target per width ``n``: the per-width table a cost model reads."""
        return {n: self.target.v(n) for n in sorted(self.target.step_s)}

    @property
    def max_k(self) -> int:
        return max(self.target.step_s) - 1

    def verify_grid(self) -> dict[int, dict[int, float]]:
        """Seconds of one verify forward per width at batch 1, as ``specdecode.costmodel.Grid``
        (batch -> width -> seconds): a measured prior in place of the linear model."""
        return {1: dict(sorted(self.target.step_s.items()))}

    def c(self, draft: str) -> float:
        """A draft model's step in target steps (both one-token forwards after the same context)."""
        return self.drafts[draft].step_s[1] / self.target.step_s[1]

    def costs(self) -> dict[str, float]:
        """Every drafter this profile prices: a free lookup (n-gram, suffix: ``c = 0``) and each draft model."""
        return {"lookup (c = 0)": 0.0} | {f"draft {d}": self.c(d) for d in self.drafts}

    def obstacle(self, name: str, c: float) -> str:
        """One line for drafter ``name`` of cost ``c``: where it can pay, or which cost stands in the way."""
        v, k_max = self.v, self.max_k
        k, best = best_k(v, c)
        if best > 1.0:
            alpha = break_even_alpha(v, k, c)
            return (
                f"{name}: pays at best at k = {k} (verify of {k + 1} costs {v[k + 1]:.2f} steps"
                + (f", drafting {k * c:.2f}" if c else "")
                + f"): up to {best:.2f}x with every draft accepted, break-even at acceptance {alpha:.2f}"
            )
        _, free_best = best_k(v, 0.0)
        if free_best <= 1.0:
            return (
                f"{name}: verify stands in the way: a forward of n tokens costs at least n steps here "
                f"(v(5) = {v.get(5, v[k_max + 1]):.2f}); not even a free drafter whose every draft is accepted pays"
            )
        k = max(range(1, k_max + 1), key=lambda k: max_draft_cost(v, k))  # where the dearest drafter still pays
        most = max_draft_cost(v, k)
        return (
            f"{name}: its cost stands in the way: c = {c:.2f}; verify of {k + 1} costs {v[k + 1]:.2f} steps, so "
            f"k = {k} breaks even only at {break_even(v, k, c):.2f} tokens per step (at most {k + 1}); no drafter "
            f"with c >= {most:.2f} breaks even at any k <= {k_max}"
        )

    def to_json(self) -> dict:
        return {
            "format": FORMAT,
            "key": self.key,
            "backend": self.backend,
            "threads": self.threads,
            "machine": {"cpu": self.machine.cpu, "flags": list(self.machine.flags)},
            "context": self.context,
            "target": self.target.to_json(),
            "drafts": {name: d.to_json() for name, d in self.drafts.items()},
            "others_cpu": self.others_cpu,
            "spread": self.spread,
            "measured_s": self.measured_s,
            "created": self.created,
        }

    def summary(self) -> dict:
        """The derived numbers (v, c, break-even, ceilings) as plain data, for the JSON result."""
        v = self.v
        ks = range(1, self.max_k + 1)
        return {
            "tok_s": self.target.tok_s,
            "v": {n: round(x, 4) for n, x in v.items()},
            "output_share": {n: self.target.output_share(n) for n in v},
            "limit": limit(v),
            "drafters": {
                name: {
                    "c": c,
                    "break_even_tokens": {k: break_even(v, k, c) for k in ks},
                    "ceiling": {k: ceiling(v, k, c) for k in ks},
                    "break_even_alpha": {k: break_even_alpha(v, k, c) for k in ks},
                    "verdict": self.obstacle(name, c),
                }
                for name, c in self.costs().items()
            },
        }

    @staticmethod
    def from_json(data: dict) -> Profile:
        if data.get("format") != FORMAT:
            raise ValueError(f"profile format {data.get('format')!r}, expected {FORMAT}")
        m = data["machine"]
        return Profile(
            data["backend"],
            int(data["threads"]),
            Machine(m["cpu"], tuple(m.get("flags", ()))),
            int(data["context"]),
            ModelCost.from_json(data["target"]),
            {name: ModelCost.from_json(d) for name, d in data.get("drafts", {}).items()},
            float(data.get("others_cpu", 0.0)),
            float(data.get("spread", 1.0)),
            float(data.get("measured_s", 0.0)),
            data.get("created", ""),
            data.get("key", ""),
        )

"""A profile as text (markdown tables and one verdict per drafter) and as a plot."""

from __future__ import annotations

import math
from pathlib import Path

from specdecode.profile.result import Profile, best_k, break_even, break_even_alpha, ceiling, limit


def _row(name: str, cells) -> str:
    return f"| {name} | " + " | ".join(cells) + " |"


def text(profile: Profile, cached_from: str | None = None) -> str:
    """The profile of one backend: v(n) and output-layer shares, then per drafter and k the break-even tokens
    per step, the ceiling and the break-even acceptance, then one verdict per drafter."""
    from specdecode.costmodel import Noise

    t, v = profile.target, profile.v
    ns = sorted(v)
    ks = range(1, profile.max_k + 1)
    where = f"cached from {cached_from}" if cached_from else f"measured in {profile.measured_s:.0f} s"
    lines = [
        f"## {profile.backend}: {t.spec} ({t.description})",
        (
            f"one-token decode {t.tok_s:.1f} tok/s ({1e3 * t.step_s[1]:.1f} ms) after {profile.context} tokens of "
            f"context; {profile.threads} thread{'s' if profile.threads != 1 else ''}; medians of {t.repeats} rounds, {where}"
        ),
    ]
    noise = Noise(profile.others_cpu, profile.spread)
    if not noise.quiet:
        lines.append(f"the machine was busy while it was measured ({noise.describe()}): ratios are less certain")
    lines += [
        "",
        _row("n (tokens in one forward)", map(str, ns)),
        "|---" * (len(ns) + 1) + "|",
        _row("v(n) = time(n) / time(1)", (f"{v[n]:.2f}" for n in ns)),
        _row("ms", (f"{1e3 * t.step_s[n]:.3g}" for n in ns)),
    ]
    shares = [t.output_share(n) for n in ns]
    if any(s is not None for s in shares):
        lines.append(_row("output layer share", ("-" if s is None else f"{s:.0%}" for s in shares)))
    for name, d in profile.drafts.items():
        share = d.output_share(1)
        lines.append(
            f"draft {name} ({d.description}): {1e3 * d.step_s[1]:.1f} ms a step, c = {profile.c(name):.2f} of a "
            "target step" + ("" if share is None else f"; output layer {share:.0%} of its step")
        )
    lim = limit(v)
    lines += [
        "",
        (
            "speculation pays when tokens per step > v(k + 1) + k * c; ceiling = (k + 1) / (v(k + 1) + k * c), "
            "every draft accepted; break-even acceptance: the acceptance per token at which it pays"
        ),
        "",
        _row("k (drafts per step)", map(str, ks)),
        "|---" * (len(ks) + 1) + "|",
    ]
    for name, c in profile.costs().items():
        alphas = [break_even_alpha(v, k, c) for k in ks]
        lines += [
            _row(f"{name}: break-even tokens/step", (f"{break_even(v, k, c):.2f}" for k in ks)),
            _row(f"{name}: ceiling", (f"{ceiling(v, k, c):.2f}x" for k in ks)),
            _row(f"{name}: break-even acceptance", ("never" if a is None else f"{a:.2f}" for a in alphas)),
        ]
    lines += [
        "",
        "limit of any draft length, every draft accepted (fit time(n) = a + b * n, time(1) / b): "
        + ("none (time does not grow with n)" if math.isinf(lim) else f"{lim:.2f}x"),
    ]
    lines += [profile.obstacle(name, c) for name, c in profile.costs().items()]
    return "\n".join(lines)


def against_the_bar(profiles: list[Profile]) -> tuple[str, list[tuple[str, str, int, float]]]:
    """The fastest one-token decode among ``profiles`` (the bar: the fastest ordinary decoder here), and per
    backend and drafter the best ceiling against it: (backend, drafter, k, speedup over the bar)."""
    bar = max(profiles, key=lambda p: p.target.tok_s)
    rows = []
    for p in profiles:
        for name, c in p.costs().items():
            k, best = best_k(p.v, c)
            rows.append((p.backend, name, k, best * p.target.tok_s / bar.target.tok_s))
    return bar.backend, rows


def bar_text(profiles: list[Profile]) -> str:
    """The bar and each backend's ceiling against it (a torch ceiling over torch's own target-only decoding
    can hide that llama.cpp alone is faster still)."""
    name, rows = against_the_bar(profiles)
    fastest = next(p for p in profiles if p.backend == name)
    head = (
        f"the bar: {name}'s one-token decode, {fastest.target.tok_s:.1f} tok/s, the fastest here; the ceiling of "
        "exact speculation against it (every draft accepted, best k):"
    )
    lines = [head]
    lines += [f"- {backend}, {drafter}: {x:.2f}x at k = {k}" for backend, drafter, k, x in rows]
    return "\n".join(lines)


def plot(profiles: list[Profile], path: Path) -> Path:
    """v(n) per backend (left) and the ceiling per drafter and k (right), as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    top = max(max(p.v) for p in profiles)
    bar = max(profiles, key=lambda p: p.target.tok_s)
    left.plot([1, top], [1, top], color="0.7", linestyle=":", label="n separate steps")
    left.axhline(1.0, color="0.7", linewidth=0.8)
    for p in profiles:
        v = p.v
        (line,) = left.plot(list(v), list(v.values()), marker="o", label=f"{p.backend}: every row's logits")
        t = p.target
        if t.layers_s:
            ns = sorted(t.layers_s)
            left.plot(
                ns,
                [t.layers_s[n] / t.step_s[1] for n in ns],
                linestyle="--",
                color=line.get_color(),
                label=f"{p.backend}: layers only",
            )
        scale = p.target.tok_s / bar.target.tok_s  # over the fastest one-token decode here, not its own
        for name, c in p.costs().items():
            ks = list(range(1, p.max_k + 1))
            right.plot(ks, [ceiling(v, k, c) * scale for k in ks], marker=".", label=f"{p.backend}, {name}")
    left.set(xlabel="tokens in one forward (n)", ylabel="time / one-token step", title="verify cost v(n)")
    right.axhline(1.0, color="0.5", linewidth=0.8)
    right.set(
        xlabel="drafts per step (k)",
        ylabel=f"speedup over {bar.backend} alone, every draft accepted",
        title="ceiling of exact speculation against the fastest decoder here",
    )
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    machine = profiles[0].machine
    threads = profiles[0].threads
    fig.suptitle(f"{machine.cpu}, {threads} thread{'s' if threads != 1 else ''}: {machine.simd()}", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

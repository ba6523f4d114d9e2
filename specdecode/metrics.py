"""Speculation counters and the rates derived from them.

Conventions (used everywhere in the toolkit: CLI, benchmarks, server, check):

* a *target step* is one verification forward pass of the target over ``[pending, d_1..d_k]``
  (``k = 0`` for target-only decoding); the prompt prefill is not a step;
* *drafted* counts proposed tokens that were verified; *accepted* those that passed; with trees,
  *drafted* counts the depth of each step's tree (the chain it stands in for) and *nodes* every tree
  node verified (for chains ``nodes == drafted``);
* ``acceptance_rate = accepted / drafted`` (``None`` when nothing was drafted);
* ``tokens_per_step = emitted / target_steps``, where *emitted* counts every token a step added to
  the output **including** the recovered/bonus token, after cutting at EOS / stop / length. Target-only
  decoding therefore has ``tokens_per_step == 1``. (vLLM calls this the mean acceptance length.)
* per-position acceptance ``accepted_at[j] / drafted_at[j]`` is the rate at which the ``j``-th draft
  token (0-based) was accepted, among steps that drafted at least ``j + 1`` tokens;
* ``choices`` (only with ``--draft-policy auto``) counts the steps a sequence took with each choice
  of the selector: ``<drafter>:k<k>`` or ``off`` (no drafting);
* times are wall-clock seconds of the batched steps a sequence took part in, split into the drafter
  (``draft_s``) and target verification including the acceptance test (``verify_s``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class SpecStats:
    target_steps: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0
    nodes: int = 0
    drafted_at: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)
    draft_s: float = 0.0
    verify_s: float = 0.0
    prefill_s: float = 0.0
    prefill_copied: int = 0  # prompt tokens whose cache was copied from an equal prompt's (Engine.prefill)
    prefill_cached: int = 0  # prompt tokens restored from the prefix cache (specdecode.prefix_cache), not computed
    choices: dict[str, int] = field(default_factory=dict)  # --draft-policy auto: steps per choice ("ngram:k4", "off")

    def record_choice(self, label: str) -> None:
        self.choices[label] = self.choices.get(label, 0) + 1

    def record_step(self, num_draft: int, num_accepted: int, num_emitted: int, num_nodes: int | None = None) -> None:
        self.target_steps += 1
        self.nodes += num_draft if num_nodes is None else num_nodes
        self.drafted += num_draft
        self.accepted += num_accepted
        self.emitted += num_emitted
        if num_draft > len(self.drafted_at):
            grow = num_draft - len(self.drafted_at)
            self.drafted_at += [0] * grow
            self.accepted_at += [0] * grow
        for j in range(num_draft):
            self.drafted_at[j] += 1
        for j in range(num_accepted):
            self.accepted_at[j] += 1

    def merge(self, other: SpecStats) -> None:
        for name in (
            "target_steps",
            "drafted",
            "accepted",
            "emitted",
            "nodes",
            "draft_s",
            "verify_s",
            "prefill_s",
            "prefill_copied",
            "prefill_cached",
        ):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        n = max(len(self.drafted_at), len(other.drafted_at))
        pad = lambda xs: xs + [0] * (n - len(xs))  # noqa: E731
        self.drafted_at = [a + b for a, b in zip(pad(self.drafted_at), pad(other.drafted_at))]
        self.accepted_at = [a + b for a, b in zip(pad(self.accepted_at), pad(other.accepted_at))]
        for label, n in other.choices.items():
            self.choices[label] = self.choices.get(label, 0) + n

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def tokens_per_step(self) -> float | None:
        return self.emitted / self.target_steps if self.target_steps else None

    @property
    def acceptance_by_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at)]

    def to_dict(self) -> dict:
        out = asdict(self)
        out["acceptance_rate"] = self.acceptance_rate
        out["tokens_per_step"] = self.tokens_per_step
        out["acceptance_by_position"] = self.acceptance_by_position
        return out


def aggregate(stats: list[SpecStats]) -> SpecStats:
    total = SpecStats()
    for s in stats:
        total.merge(s)
    return total

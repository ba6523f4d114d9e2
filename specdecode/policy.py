"""How many tokens to draft for each sequence at each step.

A policy answers ``plan(seqs, batch_size)`` before a step with a :class:`Plan`: one draft length per
sequence that may draft (most policies decide per sequence with ``num_draft``) and, for a policy that
chooses among drafters, the catch-up reads a late drafter must do before it proposes. Planning only
decides: it runs no model (the engine has the drafter side do the reads, then propose). It hears
``observe(seq, drafted, accepted)`` for each sequence and ``observe_step(...)`` for the whole step after
it, and ``forget(seq)`` when the sequence finishes. ``label(seq, k)`` names the choice for per-request
stats (``None``: nothing worth recording). It only changes speed, never the output law: verification is
exact for any draft length. The workload-aware selector that also picks the drafter lives in
:mod:`specdecode.selector`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from specdecode.config import default


@dataclass(frozen=True)
class Read:
    """A catch-up a plan asks for: drafter ``part`` reads at most ``budget`` tokens, in all, of what ``seqs``
    (in that order) have and it has not read, without drafting (:meth:`specdecode.drafters.multi.Parts.read`)."""

    part: str
    seqs: tuple
    budget: int


@dataclass(frozen=True)
class Plan:
    """A step's plan: what to draft, and what to read first. Plain data; making it runs nothing."""

    lengths: list[int]  # per planned sequence: tokens to draft (0: none)
    reads: tuple[Read, ...] = ()  # catch-up reads before anything is proposed, in order


class DraftPolicy(Protocol):
    """What the engine asks of a policy. ``plan``, ``idle``, ``observe_step`` and ``label`` have
    defaults in :class:`PerSequence` (decide each sequence alone with ``num_draft``; nothing to do
    when idle or after a step; no label): a policy that needs more overrides them."""

    max_k: int  # the longest draft it can ask for (sizes the verify window in the KV cache)

    def num_draft(self, seq, batch_size: int) -> int: ...

    def observe(self, seq, drafted: int, accepted: int) -> None: ...

    def forget(self, seq) -> None: ...

    def plan(self, seqs: list, batch_size: int) -> Plan: ...

    def idle(self, seqs: list) -> None:
        """A step in which nothing may draft (a verify budget at its cap): no plan is asked for."""

    def observe_step(self, batch_size: int, width: int, draft_s: float, verify_s: float) -> None: ...

    def label(self, seq, k: int) -> str | None: ...

    def explain(self) -> dict | None:
        """What the policy's choices rest on, for reports (None: nothing beyond its settings)."""


class PerSequence:
    """Defaults for policies that decide each sequence on its own."""

    def plan(self, seqs: list, batch_size: int) -> Plan:
        return Plan([self.num_draft(s, batch_size) for s in seqs])  # type: ignore[attr-defined]

    def idle(self, seqs: list) -> None:
        pass

    def observe_step(self, batch_size: int, width: int, draft_s: float, verify_s: float) -> None:
        pass

    def label(self, seq, k: int) -> str | None:
        return None

    def explain(self) -> dict | None:
        return None


def _check_k(name: str, k: int) -> int:
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ValueError(f"{name} must be an integer >= 0, got {k!r}")
    return k


class FixedPolicy(PerSequence):
    """Always draft ``k`` tokens (``k = 0`` is target-only decoding)."""

    def __init__(self, k: int) -> None:
        self.k = self.max_k = _check_k("draft length", k)

    def num_draft(self, seq, batch_size: int) -> int:
        return self.k

    def observe(self, seq, drafted: int, accepted: int) -> None:
        pass

    def forget(self, seq) -> None:
        pass


class AcceptancePolicy(PerSequence):
    """Per-sequence draft length driven by acceptance: grow by ``grow`` after a step that accepted
    every draft token, shrink by 1 after one that rejected, within ``[min_k, max_k]``.

    Long drafts pay where acceptance is high and verification of many tokens is cheap; the state is
    per sequence, so one hard prompt does not shorten the drafts of the others.
    """

    def __init__(
        self,
        start_k: int = default("num_draft_tokens"),
        max_k: int = default("max_draft_tokens"),
        min_k: int = 1,
        grow: int = 2,
    ) -> None:
        self.min_k, self.max_k = _check_k("min draft length", min_k), _check_k("max draft length", max_k)
        self.start_k, self.grow = _check_k("start draft length", start_k), _check_k("growth", grow)
        if not self.min_k <= self.start_k <= self.max_k:
            raise ValueError(f"need min_k <= start_k <= max_k, got {min_k}, {start_k}, {max_k}")
        self._k: dict[int, int] = {}  # id(seq) -> current draft length

    def num_draft(self, seq, batch_size: int) -> int:
        return self._k.setdefault(id(seq), self.start_k)

    def observe(self, seq, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        k = self._k.get(id(seq), self.start_k)
        k = k + self.grow if accepted == drafted else k - 1
        self._k[id(seq)] = max(self.min_k, min(self.max_k, k))

    def forget(self, seq) -> None:
        self._k.pop(id(seq), None)


class BudgetPolicy(PerSequence):
    """Caps another policy by load: a step verifies at most ``budget`` tokens across the batch, so
    each of ``B`` sequences drafts at most ``budget // B - 1`` (0 = target-only once ``B`` reaches
    ``budget``). Under load the target's forward is already wide and verification stops being
    nearly free; the cap moves the server from speculation towards plain batched decoding.
    """

    def __init__(self, inner: DraftPolicy, budget: int) -> None:
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
            raise ValueError(f"verify budget must be an integer >= 1, got {budget!r}")
        self.inner, self.budget, self.max_k = inner, budget, inner.max_k

    def num_draft(self, seq, batch_size: int) -> int:
        return min(self.inner.num_draft(seq, batch_size), self._cap(batch_size))

    def _cap(self, batch_size: int) -> int:
        return max(0, self.budget // max(1, batch_size) - 1)

    def plan(self, seqs: list, batch_size: int) -> Plan:
        cap = self._cap(batch_size)
        if cap == 0:  # not planned at all (nor are a planner's reads ahead: nothing would draft after them)
            self.inner.idle(seqs)
            return Plan([0] * len(seqs))
        inner = self.inner.plan(seqs, batch_size)
        return Plan([min(k, cap) for k in inner.lengths], inner.reads)

    def idle(self, seqs: list) -> None:
        self.inner.idle(seqs)

    def observe(self, seq, drafted: int, accepted: int) -> None:
        self.inner.observe(seq, drafted, accepted)

    def observe_step(self, batch_size: int, width: int, draft_s: float, verify_s: float) -> None:
        self.inner.observe_step(batch_size, width, draft_s, verify_s)

    def label(self, seq, k: int) -> str | None:
        return self.inner.label(seq, k)

    def explain(self) -> dict | None:
        return self.inner.explain()

    def forget(self, seq) -> None:
        self.inner.forget(seq)

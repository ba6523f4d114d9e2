"""Fault isolation around a drafter (the server's engines: ``EngineSettings(isolate_drafter_faults=True)``; the
engine's :class:`specdecode.drafters.session.DraftSession` wraps its drafter, and counts what was absorbed).

It only ever *reduces* what is drafted (a row's proposal may be shorter than requested, down to
zero: the engine then decodes that row target-only), so outputs stay exactly those of the target. A
drafter exception never reaches the engine. When a call for several rows fails, each row is retried
alone (drafters roll their per-slot state back to what agrees with the sequence, so a retry is
safe): the innocent rows keep drafting; a row that fails alone falls back to target-only decoding for
the rest of its request and the drafter's state for its slot is released. New requests try drafting
again.
"""

from __future__ import annotations

import logging
from typing import Callable, Sequence, cast

import torch

from specdecode.drafters.base import Drafter, DrafterBase, KeepsHistory, Proposal, SequenceView, TargetFeatures
from specdecode.drafters.multi import MultiDrafter, merge

log = logging.getLogger("specdecode.drafters")


class GuardedDrafter(DrafterBase):
    def __init__(
        self,
        inner: Drafter,
        on_failure: Callable[[str], None] = lambda where: None,
        on_retry: Callable[[str, int], None] = lambda where, rows: None,
    ) -> None:
        self.inner = inner
        self.name = inner.name
        self.feature_layers = tuple(inner.feature_layers)
        self.max_tree_nodes = inner.max_tree_nodes
        self.live: set[int] = set()  # slots the inner drafter holds state for
        self._on_failure = on_failure
        self._on_retry = on_retry  # (where, rows retried alone after a call for several rows failed)
        self.failures = 0  # calls that failed for good (a row then decodes target-only), so far
        self.retries = 0  # rows retried alone after a call for several rows failed, so far

    def _failed(self, where: str, slots: Sequence[int]) -> None:
        log.exception("drafter failed in %s; slots %s fall back to target-only decoding", where, list(slots))
        self.failures += 1
        self._on_failure(where)
        for slot in slots:
            self.release(slot)

    def _each_alone(self, where: str, rows: list, call: Callable, slot_of: Callable) -> list:
        """After a call for several ``rows`` failed: ``call([row])`` for each row alone; a row that fails
        alone is released. Returns the rows that succeeded, with their results."""
        log.warning("drafter failed in %s for %d rows; retrying each alone", where, len(rows), exc_info=True)
        self.retries += len(rows)
        self._on_retry(where, len(rows))
        done = []
        for row in rows:
            try:
                done.append((row, call([row])))
            except Exception:
                self._failed(where, [slot_of(row)])
        return done

    def reserve(self, num_slots: int, max_len: int) -> None:
        self.inner.reserve(num_slots, max_len)  # at engine construction: a failure here is a setup error

    def runners(self):
        return self.inner.runners()

    def start(self, slots: list[int], prompts: list[list[int]]) -> None:
        try:
            self.inner.start(slots, prompts)
            self.live.update(slots)
        except Exception:
            if len(slots) == 1:
                return self._failed("start", slots)
            rows = list(zip(slots, prompts))
            for (slot, _), _ in self._each_alone(
                "start", rows, lambda r: self.inner.start([r[0][0]], [r[0][1]]), lambda r: r[0]
            ):
                self.live.add(slot)

    def prefill(self, slots: list[int], pieces: list[list[int]], starts: list[int]) -> bool:
        prefill = self.inner.prefill
        try:
            done = prefill(slots, pieces, starts)
        except Exception:
            if len(slots) == 1:
                self._failed("prefill", slots)
                return False  # the engine then starts them whole (and that, guarded too, may fall back)
            rows = list(zip(slots, pieces, starts))
            ok = self._each_alone("prefill", rows, lambda r: prefill([r[0][0]], [r[0][1]], [r[0][2]]), lambda r: r[0])
            if len(ok) < len(rows) or not all(done for _, done in ok):
                return False  # the rows that succeeded keep what they cached; start does the rest
            done = True
        if done:
            self.live.update(slots)
        return done

    def observe(self, slots: list[int], features: list[TargetFeatures]) -> None:
        rows = [i for i, s in enumerate(slots) if s in self.live]
        if not rows:
            return
        try:
            self.inner.observe([slots[i] for i in rows], [features[i] for i in rows])
        except Exception:
            if len(rows) == 1:
                return self._failed("observe", [slots[rows[0]]])
            self._each_alone(
                "observe", rows, lambda r: self.inner.observe([slots[r[0]]], [features[r[0]]]), lambda i: slots[i]
            )

    def propose(self, seqs: Sequence[SequenceView], num_tokens: list[int]) -> Proposal:
        ks = [k if s.slot in self.live else 0 for s, k in zip(seqs, num_tokens)]
        if not any(ks):
            return Proposal.empty(len(seqs))
        rows = [b for b, k in enumerate(ks) if k]
        # each row's random state before the call: a row retried alone draws what it would have drawn,
        # so an innocent seeded request samples the same tokens whether or not another row failed
        states = {b: _rng_state(seqs[b]) for b in rows} if len(rows) > 1 else {}
        try:
            return self.inner.propose(seqs, ks)
        except Exception:
            if len(rows) == 1:
                self._failed("propose", [seqs[rows[0]].slot])
                return Proposal.empty(len(seqs))

        def alone(r: list[int]) -> Proposal:
            _set_rng_state(seqs[r[0]], states[r[0]])
            return self.inner.propose([seqs[r[0]]], [ks[r[0]]])

        parts = self._each_alone("propose", rows, alone, lambda b: seqs[b].slot)
        return _merge_rows(len(seqs), [([b], p) for b, p in parts])

    def move(self, src: int, dst: int) -> None:
        if src not in self.live:
            return
        try:
            self.inner.move(src, dst)
            self.live.discard(src)
            self.live.add(dst)
        except Exception:
            self._failed("move", [src, dst])

    def release(self, slot: int) -> None:
        if slot not in self.live:
            return
        self.live.discard(slot)
        try:
            self.inner.release(slot)
        except Exception:
            log.exception("drafter failed to release slot %d", slot)

    def read_ahead(self, reads) -> None:
        """A plan's catch-up reads (a multi-drafter's); a failure makes the rows involved decode target-only."""
        try:
            cast(MultiDrafter, self.inner).read_ahead(reads)  # (only a multi-drafter's plans have reads)
        except Exception:
            self._failed("read", sorted({s.slot for r in reads for s in r.seqs} & self.live))

    def forget_outputs(self) -> None:
        cast(KeepsHistory, self.inner).forget_outputs()

    def remember(self, output: list[int]) -> None:
        cast(KeepsHistory, self.inner).remember(output)


def _rng_state(seq: SequenceView):
    generator = getattr(seq, "generator", None)
    return None if generator is None else generator.get_state()


def _set_rng_state(seq: SequenceView, state) -> None:
    if state is not None:
        seq.generator.set_state(state)


def _merge_rows(batch: int, parts: list[tuple[list[int], Proposal]]) -> Proposal:
    """One proposal for ``batch`` rows from proposals for some of them (the rows retried alone). Chains
    merge as the selector's parts do; trees keep the parts drawn under the first part's rule (a tree's
    rule is per proposal), and the other rows draft nothing this step."""
    trees = [(rows, p) for rows, p in parts if p.parents is not None and int(p.num_tokens.sum())]
    if not trees:
        return merge(batch, [(rows, p) for rows, p in parts if p.parents is None])
    rule, has_probs = trees[0][1].rule, trees[0][1].probs is not None
    trees = [(rows, p) for rows, p in trees if p.rule == rule and (p.probs is not None) == has_probs]
    first = trees[0][1]
    width = max(p.tokens.shape[1] for _, p in trees)
    dev = first.tokens.device
    tokens = torch.zeros(batch, width, dtype=torch.long, device=dev)
    parents = torch.full((batch, width), -1, dtype=torch.long, device=dev)
    num = torch.zeros(batch, dtype=torch.long, device=dev)
    first_probs = first.probs  # (None exactly when not has_probs: first is trees[0][1])
    probs = (
        None
        if first_probs is None
        else torch.zeros(batch, width, first_probs.shape[-1], dtype=first_probs.dtype, device=first_probs.device)
    )
    for rows, p in trees:
        assert p.parents is not None  # trees only (the filter above)
        for i, b in enumerate(rows):
            n = int(p.num_tokens[i])
            tokens[b, :n], parents[b, :n], num[b] = p.tokens[i, :n], p.parents[i, :n], n
            if probs is not None:
                assert p.probs is not None  # every tree kept has probs when the first has (has_probs)
                probs[b, :n] = p.probs[i, :n]
    return Proposal(tokens, probs, num, parents, rule)

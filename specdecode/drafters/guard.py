"""Fault isolation around a drafter (used by the server through ``Engine.isolate_drafter_faults``).

It only ever *reduces* what is drafted (a row's proposal may be shorter than requested, down to
zero: the engine then decodes that row target-only), so outputs stay exactly those of the target. A
drafter exception never reaches the engine: the rows involved fall back to target-only decoding for
the rest of their request, the drafter's state for their slots is released, and new requests try
drafting again.
"""

from __future__ import annotations

import logging
from typing import Callable, Sequence

from specdecode.drafters.base import Drafter, Proposal, SequenceView, TargetFeatures

log = logging.getLogger("specdecode.drafters")


class GuardedDrafter:
    def __init__(self, inner: Drafter, on_failure: Callable[[str], None] = lambda where: None) -> None:
        self.inner = inner
        self.name = inner.name
        self.feature_layers = tuple(inner.feature_layers)
        self.max_tree_nodes = getattr(inner, "max_tree_nodes", 0)
        self.live: set[int] = set()  # slots the inner drafter holds state for
        self._on_failure = on_failure

    def _failed(self, where: str, slots: Sequence[int]) -> None:
        log.exception("drafter failed in %s; slots %s fall back to target-only decoding", where, list(slots))
        self._on_failure(where)
        for slot in slots:
            self.release(slot)

    def reserve(self, num_slots: int, max_len: int) -> None:
        self.inner.reserve(num_slots, max_len)  # at engine construction: a failure here is a setup error

    def runners(self):
        return self.inner.runners()

    def start(self, slots: list[int], prompts: list[list[int]]) -> None:
        try:
            self.inner.start(slots, prompts)
            self.live.update(slots)
        except Exception:
            self._failed("start", slots)

    def prefill(self, slots: list[int], pieces: list[list[int]], starts: list[int]) -> bool:
        prefill = getattr(self.inner, "prefill", None)
        if prefill is None:
            return False
        try:
            done = prefill(slots, pieces, starts)
        except Exception:
            self._failed("prefill", slots)
            return False  # the engine then starts them whole (and that, guarded too, may fall back)
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
            self._failed("observe", [slots[i] for i in rows])

    def propose(self, seqs: Sequence[SequenceView], num_tokens: list[int]) -> Proposal:
        ks = [k if s.slot in self.live else 0 for s, k in zip(seqs, num_tokens)]
        if any(ks):
            try:
                return self.inner.propose(seqs, ks)
            except Exception:
                self._failed("propose", [s.slot for s, k in zip(seqs, ks) if k])
        return Proposal.empty(len(seqs))

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

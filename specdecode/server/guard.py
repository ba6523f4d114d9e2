"""A drafter wrapper for serving: per-request opt-out, a server-wide switch, and fault isolation.

It sits between the engine and the real drafter and only ever *reduces* what is drafted (a row's
proposal may be shorter than requested, down to zero: the engine then decodes that row
target-only), so outputs stay exactly those of the target. A drafter exception never reaches the
engine: the rows involved fall back to target-only decoding for the rest of their request, the
drafter's state for their slots is released, and new requests try drafting again.
"""

from __future__ import annotations

import logging
from typing import Callable, Sequence

import torch

from specdecode.drafters.base import Drafter, Proposal, SequenceView

log = logging.getLogger("specdecode.server")


class GuardedDrafter:
    def __init__(self, inner: Drafter, on_failure: Callable[[str], None] = lambda where: None) -> None:
        self.inner = inner
        self.name = inner.name
        self.enabled = True  # server-wide switch
        self.opted_out: set[str] = set()  # request ids decoded without a draft
        self.live: set[int] = set()  # slots the inner drafter holds state for
        self._on_failure = on_failure

    def _failed(self, where: str, slots: Sequence[int]) -> None:
        log.exception("drafter failed in %s; slots %s fall back to target-only decoding", where, list(slots))
        self._on_failure(where)
        for slot in slots:
            self.release(slot)

    def start(self, slots: list[int], prompts: list[list[int]]) -> None:
        try:
            self.inner.start(slots, prompts)
            self.live.update(slots)
        except Exception:
            self._failed("start", slots)

    def propose(self, seqs: Sequence[SequenceView], num_tokens: list[int]) -> Proposal:
        ks = [k if self._drafts(s) else 0 for s, k in zip(seqs, num_tokens)]
        if any(ks):
            try:
                return self.inner.propose(seqs, ks)
            except Exception:
                self._failed("propose", [s.slot for s, k in zip(seqs, ks) if k])
        bsz = len(seqs)
        return Proposal(torch.zeros(bsz, 0, dtype=torch.long), None, torch.zeros(bsz, dtype=torch.long))

    def _drafts(self, seq: SequenceView) -> bool:
        return self.enabled and seq.slot in self.live and getattr(seq, "request_id", None) not in self.opted_out

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

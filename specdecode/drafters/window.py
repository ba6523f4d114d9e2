"""A bounded draft context (``--draft-context N``): the draft model reads only the last ``N`` tokens of a
prompt. The target still reads and verifies everything, so the output is exact; only the draft's proposals
(acceptance) and its prefill (the draft's share of time to first token) change.

The drafter keeps speaking absolute positions: it treats a slot's first ``offset`` tokens as read, and
:class:`WindowedRunner` maps every position it hands the draft runner to ``position - offset``, so the slot's
cache holds the window from index 0 on. RoPE scores depend on position differences only, so a window
computes what it would at its absolute positions, and a static cache never holds unwritten entries below
the window (they would be attended to). The offset is fixed per slot when the drafter first sees it, from
the prompt (or the history, for a late start), and never moves: generated tokens extend the window.
"""

from __future__ import annotations

from typing import Sequence

import torch

from specdecode.models.base import ForwardOutput, Runner


def window_start(length: int, context: int) -> int:
    """Where the window of a sequence of ``length`` tokens starts (its last token is read by the first
    proposal, not by the prefill): ``context`` tokens before that last one, moved back to a multiple of a
    quarter of ``context``, so the draft reads ``context`` to 1.25 ``context`` tokens of it (0 = all).

    The step is for the draft's prefix cache: it keys a window's tokens from the window's start, so an edited or
    grown prompt (an editor's next keystroke, a chat's next turn) finds the window it shares with an earlier
    prompt only if both start at the same token; with the start on a coarse grid, most do."""
    start = length - 1 - context
    if context <= 0 or start <= 0:
        return 0
    step = max(1, context // 4)
    return start // step * step


class WindowedRunner:
    """The draft runner as a drafter with a bounded context sees it: positions are absolute, each slot's
    cache starts at its offset. Only what a draft model drafter calls is mapped; the rest is the runner's."""

    def __init__(self, runner: Runner, context: int) -> None:
        self.runner = runner
        self.context = context
        self.offsets: dict[int, int] = {}  # slot -> tokens of its sequence the draft never reads

    def begin(self, slot: int, tokens: Sequence[int]) -> int:
        """The slot's offset, fixed the first time it is asked for (from ``tokens``: its prompt or history)."""
        if slot not in self.offsets:
            self.offsets[slot] = window_start(len(tokens), self.context)
        return self.offsets[slot]

    def offset(self, slot: int) -> int:
        return self.offsets.get(slot, 0)

    def __getattr__(self, name: str):  # max_len, device, logits, export_kv ...: the runner's own
        return getattr(self.runner, name)

    def prefill(self, slots: Sequence[int], pieces: Sequence[list[int]], starts: Sequence[int]) -> None:
        """Each piece from its start, less the part before its slot's window."""
        keep = []
        for slot, piece, start in zip(slots, pieces, starts):
            o = self.offset(slot)
            cut = max(0, o - start)
            if len(piece) > cut:
                keep.append((slot, list(piece[cut:]), start + cut - o))
        if keep:
            self.runner.prefill([s for s, _, _ in keep], [p for _, p, _ in keep], starts=[st for _, _, st in keep])

    def forward(self, slots: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor, **tree) -> ForwardOutput:
        shift = torch.tensor([self.offset(int(s)) for s in slots], dtype=positions.dtype)
        if not shift.any():
            return self.runner.forward(slots, ids, positions, **tree)
        top = self.runner.max_len - 1

        def move(p: torch.Tensor) -> torch.Tensor:
            s = shift.to(p.device)
            return (p - (s[:, None] if p.dim() == 2 else s)).clamp(min=0, max=top)

        for name in ("write_positions", "tree_start"):
            if tree.get(name) is not None:
                tree[name] = move(tree[name])
        return self.runner.forward(slots, ids, move(positions), **tree)

    def truncate(self, slot: int, length: int) -> None:
        self.runner.truncate(slot, max(0, length - self.offset(slot)))

    def compact(self, slot: int, src: Sequence[int], dst_start: int) -> None:
        o = self.offset(slot)
        self.runner.compact(slot, [p - o for p in src], dst_start - o)

    def copy_slot(self, src: int, dst: int, length: int) -> None:
        o = self.offsets.pop(src, 0)
        self.runner.copy_slot(src, dst, length - o)
        self.offsets[dst] = o

    def release(self, slot: int) -> None:
        self.offsets.pop(slot, None)

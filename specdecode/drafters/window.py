"""A bounded draft context (``--draft-context N``): the draft model reads only about ``N`` tokens of a prompt.
The target still reads and verifies everything, so the output is exact; only the draft's proposals
(acceptance) and its prefill (the draft's share of time to first token) change.

**What the draft reads** (:func:`draft_view`): the prompt's last ``N`` tokens (:func:`window_start`). A
fill-in-the-middle prompt (prefix–suffix–middle order: ``lead, <prefix>, prefix, <suffix>, suffix, <middle>``)
would lose the code before the cursor that way, since its suffix comes last; it reads instead the same
markers around the prefix's last three quarters of ``N`` tokens and the suffix's first quarter, a
well-formed FIM prompt of about ``N`` tokens ending where the original does.

**How.** The drafter keeps speaking the sequence's absolute positions and counts every prompt token as read;
:class:`WindowedRunner` holds each slot's view and maps a position ``p`` to ``p - offset`` (``offset``: the
prompt's length less the view's), so the slot's cache holds the view from index 0 on, and a prefill over the
prompt's positions writes the view's tokens there instead. The view ends with the sequence's last token, so
from that position on the two agree and generated tokens extend the view. RoPE scores depend on position
differences only, so a contiguous window computes what it would at its absolute positions, and a static
cache never holds unwritten entries below the view (they would be attended to). The view is fixed per slot
when the drafter first sees it, from the prompt (or the history, for a late start).
"""

from __future__ import annotations

from typing import Sequence

import torch

from specdecode.models.base import ForwardOutput, Runner

FimMarkers = tuple[int, int, int]  # the prefix, suffix and middle markers' ids


def window_start(length: int, context: int) -> int:
    """Where the window of a sequence of ``length`` tokens starts (its last token is read by the first
    proposal, not by the prefill): ``context`` tokens before that last one, moved back to a multiple of a
    quarter of ``context``, so the draft reads ``context`` to 1.25 ``context`` tokens of it (0 = all).

    The step is for the draft's prefix cache: it keys a view's tokens from the view's start, so an edited or
    grown prompt (an editor's next keystroke, a chat's next turn) finds the window it shares with an earlier
    prompt only if both start at the same token; with the start on a coarse grid, most do."""
    start = length - 1 - context
    if context <= 0 or start <= 0:
        return 0
    step = max(1, context // 4)
    return start // step * step


def draft_view(tokens: Sequence[int], context: int, fim: FimMarkers | None = None) -> list[int]:
    """What a draft with a bounded context reads of ``tokens`` (a prompt, or a history at a late start): a
    list ending with ``tokens``' last token (see the module docstring); ``tokens`` itself when it is short."""
    tokens = list(tokens)
    if context <= 0 or len(tokens) - 1 <= context:
        return tokens
    if fim is not None:
        view = _fim_view(tokens, context, fim)
        if view is not None:
            return view
    return tokens[window_start(len(tokens), context) :]


def _fim_view(tokens: list[int], context: int, fim: FimMarkers) -> list[int] | None:
    """The FIM-aware view, or None for a prompt not in prefix–suffix–middle order."""
    p, s, m = fim
    try:
        i_p, i_s = tokens.index(p), tokens.index(s)
        i_m = len(tokens) - 1 - tokens[::-1].index(m)  # the last middle marker: what follows it was generated
    except ValueError:
        return None
    if not i_p < i_s < i_m:
        return None
    prefix, suffix, after = tokens[i_p + 1 : i_s], tokens[i_s + 1 : i_m], tokens[i_m + 1 :]
    budget = max(0, context - len(after))
    keep_suffix = min(len(suffix), budget // 4)
    keep_prefix = min(len(prefix), budget - keep_suffix)
    keep_suffix = min(len(suffix), budget - keep_prefix)  # what the prefix leaves over goes to the suffix
    cut = window_start(len(prefix) + 1, keep_prefix)  # the prefix's tail, its start on the same grid
    return [*tokens[: i_p + 1], *prefix[cut:], s, *suffix[:keep_suffix], m, *after]


class WindowedRunner:
    """The draft runner as a drafter with a bounded context sees it: positions are absolute, each slot's
    cache holds its view from index 0 (see the module docstring). Only what a draft model drafter calls is
    mapped; the rest is the runner's. With ``context`` 0 every call goes to the runner unchanged."""

    def __init__(self, runner: Runner, context: int, fim: FimMarkers | None = None) -> None:
        self.runner = runner
        self.context = context
        self.fim = fim
        self.views: dict[int, list[int]] = {}  # slot -> what the draft reads in place of its sequence's start
        self.offsets: dict[int, int] = {}  # slot -> its sequence's length less its view's (fixed)

    def begin(self, slot: int, tokens: Sequence[int]) -> list[int]:
        """The slot's view, fixed the first time it is asked for (from ``tokens``: its prompt or history);
        without a bound (``context`` 0) the tokens themselves, nothing kept."""
        if not self.context:
            return list(tokens)
        if slot not in self.views:
            view = draft_view(tokens, self.context, self.fim)
            self.views[slot], self.offsets[slot] = view, len(tokens) - len(view)
        return self.views[slot]

    def offset(self, slot: int) -> int:
        return self.offsets.get(slot, 0)

    def held(self, slot: int, cached: Sequence[int]) -> list[int]:
        """What the slot's cache holds, given the sequence tokens the drafter counts as read (``cached``)."""
        view, o = self.views.get(slot), self.offset(slot)
        if view is None:
            return list(cached)
        known = len(view) - 1  # the view's tokens before the sequence's last prompt token
        return view[: min(known, len(cached) - o)] + list(cached[o + known :])

    def __getattr__(self, name: str):  # max_len, device, logits, export_kv ...: the runner's own
        return getattr(self.runner, name)

    def prefill(self, slots: Sequence[int], pieces: Sequence[list[int]], starts: Sequence[int]) -> None:
        """Each piece at its positions in the slot's view: the view's tokens where it has them, the piece's
        own past it; nothing for the prompt's positions before the view."""
        keep = []
        for slot, piece, start in zip(slots, pieces, starts):
            o, view = self.offset(slot), self.views.get(slot, [])
            cut = max(0, o - start)
            if len(piece) <= cut:
                continue
            at = start + cut - o  # the first position written, in the view
            tokens = list(piece[cut:])
            known = max(0, min(len(tokens), len(view) - 1 - at))  # positions the view has its own token for
            keep.append((slot, view[at : at + known] + tokens[known:], at))
        if keep:
            self.runner.prefill([s for s, _, _ in keep], [p for _, p, _ in keep], starts=[st for _, _, st in keep])

    def forward(self, slots: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor, **tree) -> ForwardOutput:
        if not self.offsets:  # (no slot has a view that leaves tokens out: the runner's positions as they are)
            return self.runner.forward(slots, ids, positions, **tree)
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
        if src in self.views:
            self.views[dst] = self.views.pop(src)

    def release(self, slot: int) -> None:
        self.offsets.pop(slot, None)
        self.views.pop(slot, None)

"""The drafter protocol: every proposer (draft model, n-gram lookup, Medusa, EAGLE) implements it.

A drafter only *proposes*; exactness comes from verification, which needs the distribution each
draft token was sampled from (``Proposal.probs``), or ``None`` when proposals are deterministic.

Drafters keep their own per-slot state (e.g. a KV cache). They are never told what was accepted:
at the next ``propose`` they compare what they consumed with the sequence's tokens and roll back to
the common prefix, so state stays in step whatever happened in between (partial acceptance, full
acceptance with a bonus token, a stop cut).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from specdecode.sampling import SamplingParams


class SequenceView(Protocol):
    """What a drafter may read of a running sequence."""

    slot: int
    token_ids: list[int]  # prompt + generated so far; the last token is not yet in any cache
    params: SamplingParams
    generator: torch.Generator


@dataclass
class Proposal:
    tokens: torch.Tensor  # [B, K] long, padded past each row's num_tokens
    probs: torch.Tensor | None  # [B, K, V] warped draft distributions; None = point masses
    num_tokens: torch.Tensor  # [B] long, how many tokens row b proposes (<= requested)


class Drafter(Protocol):
    name: str

    def start(self, slots: list[int], prompts: list[list[int]]) -> None:
        """New sequences occupy ``slots``; ``prompts[i]`` is the prompt of ``slots[i]``."""

    def propose(self, seqs: Sequence[SequenceView], num_tokens: list[int]) -> Proposal:
        """Propose up to ``num_tokens[b]`` tokens continuing each sequence."""

    def move(self, src: int, dst: int) -> None:
        """The sequence in slot ``src`` now lives in slot ``dst``."""

    def release(self, slot: int) -> None:
        """The sequence in ``slot`` has finished."""


def common_prefix(a: list[int], b: list[int], start: int = 0) -> int:
    """Length of the common prefix of ``a`` and ``b``, given that the first ``start`` items agree."""
    n = min(len(a), len(b))
    i = min(start, n)
    while i < n and a[i] == b[i]:
        i += 1
    return i

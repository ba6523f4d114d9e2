"""How many tokens to draft for each sequence at each step."""

from __future__ import annotations

from typing import Protocol


class DraftPolicy(Protocol):
    def num_draft(self, batch_size: int) -> int: ...


class FixedPolicy:
    """Always draft ``k`` tokens (``k = 0`` is target-only decoding)."""

    def __init__(self, k: int) -> None:
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"draft length must be an integer >= 0, got {k!r}")
        self.k = k

    def num_draft(self, batch_size: int) -> int:
        return self.k

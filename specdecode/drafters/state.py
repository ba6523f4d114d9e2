"""What the engine keeps per sequence about its drafter: when the drafter starts on it, and what it is owed.

The drafter itself keeps its own per-slot state (a KV cache, an n-gram index); this is the engine's side
of the bookkeeping, one record per sequence (``Sequence.draft``), so the sequence itself holds only what
a request is (its tokens, its parameters, its stats).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specdecode.drafters.base import TargetFeatures


@dataclass
class DraftState:
    # the drafter has seen the prompt (the first token may come from the target alone: Engine.add_batch)
    started: bool = False
    # target features of tokens cached before the drafter started, handed over when it starts
    early_features: list[TargetFeatures] = field(default_factory=list)
    eligible: bool = True  # False once a feature drafter could no longer catch up (its features were dropped)
    prefilled: int = 0  # prompt tokens the drafter cached in chunks ahead of its start (chunked prefill)

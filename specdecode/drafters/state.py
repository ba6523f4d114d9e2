"""What the drafter side keeps per sequence about its lifecycle: when the drafter starts on it, and what it is
owed until then.

The drafter itself keeps its own per-slot state (a KV cache, an n-gram index); this record is
:class:`specdecode.drafters.session.DraftSession`'s, one per sequence (``Sequence.draft``), read and written by
the session alone: the engine never looks inside it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specdecode.drafters.base import TargetFeatures


@dataclass
class DraftState:
    # the drafter has seen the prompt (the first token may come from the target alone: DraftSession)
    started: bool = False
    # target features of tokens cached before the drafter started, handed over when it starts
    early_features: list[TargetFeatures] = field(default_factory=list)
    eligible: bool = True  # False once a feature drafter could no longer catch up (its features were dropped)
    prefilled: int = 0  # prompt tokens the drafter cached in chunks ahead of its start (chunked prefill)
    looked_up: bool = False  # its prompt was looked up in the drafter's prefix cache (chunked prefill)

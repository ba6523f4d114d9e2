"""Prompt-lookup (n-gram) drafting: copy what followed the latest earlier occurrence of the suffix.

No model, no state. Proposals are deterministic, so they are verified as point masses
(``Proposal.probs is None``), which keeps sampling exact.
"""

from __future__ import annotations

from typing import Sequence

import torch

from specdecode.drafters.base import DrafterBase, Proposal, SequenceView


def lookup(token_ids: list[int], k: int, max_ngram: int, min_ngram: int) -> list[int]:
    """Up to ``k`` tokens that followed the most recent earlier match of the longest suffix n-gram."""
    n_tokens = len(token_ids)
    for n in range(min(max_ngram, n_tokens - 1), min_ngram - 1, -1):
        suffix = token_ids[n_tokens - n :]
        for start in range(n_tokens - n - 1, -1, -1):  # latest match first, never the suffix itself
            if token_ids[start : start + n] == suffix:
                return token_ids[start + n : start + n + k]
    return []


class NgramDrafter(DrafterBase):
    name = "ngram"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, seqs: Sequence[SequenceView], num_tokens: list[int]) -> Proposal:
        found = [lookup(s.token_ids, k, self.max_ngram, self.min_ngram) if k else [] for s, k in zip(seqs, num_tokens)]
        tokens = torch.zeros(len(seqs), max(num_tokens, default=0), dtype=torch.long)
        for b, toks in enumerate(found):
            tokens[b, : len(toks)] = torch.tensor(toks, dtype=torch.long)
        return Proposal(tokens, None, torch.tensor([len(t) for t in found], dtype=torch.long))


def build(arg: str, ctx) -> NgramDrafter:
    """``--draft ngram`` (longest suffix 3 tokens) or ``ngram:MAX`` / ``ngram:MIN-MAX``."""
    if not arg:
        return NgramDrafter()
    lo, sep, hi = arg.partition("-")
    try:
        return NgramDrafter(int(hi), int(lo)) if sep else NgramDrafter(int(lo))
    except ValueError as exc:
        raise ValueError(f"bad n-gram drafter spec 'ngram:{arg}': use ngram, ngram:MAX or ngram:MIN-MAX ({exc})") from None

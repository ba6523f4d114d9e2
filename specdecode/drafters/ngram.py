"""Prompt-lookup (n-gram) drafting: copy what followed the latest earlier occurrence of the suffix.

No model, no state. Proposals are deterministic, so they are verified as point masses
(``Proposal.probs is None``), which keeps sampling exact.
"""

from __future__ import annotations

from typing import Sequence

import torch

from specdecode.drafters.base import Proposal, SequenceView


def lookup(token_ids: list[int], k: int, max_ngram: int, min_ngram: int) -> list[int]:
    """Up to ``k`` tokens that followed the most recent earlier match of the longest suffix n-gram."""
    n_tokens = len(token_ids)
    for n in range(min(max_ngram, n_tokens - 1), min_ngram - 1, -1):
        suffix = token_ids[n_tokens - n :]
        for start in range(n_tokens - n - 1, -1, -1):  # latest match first, never the suffix itself
            if token_ids[start : start + n] == suffix:
                return token_ids[start + n : start + n + k]
    return []


class NgramDrafter:
    name = "ngram"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def start(self, slots: list[int], prompts: list[list[int]]) -> None:
        pass

    def move(self, src: int, dst: int) -> None:
        pass

    def release(self, slot: int) -> None:
        pass

    def propose(self, seqs: Sequence[SequenceView], num_tokens: list[int]) -> Proposal:
        found = [lookup(s.token_ids, k, self.max_ngram, self.min_ngram) if k else [] for s, k in zip(seqs, num_tokens)]
        tokens = torch.zeros(len(seqs), max(num_tokens, default=0), dtype=torch.long)
        for b, toks in enumerate(found):
            tokens[b, : len(toks)] = torch.tensor(toks, dtype=torch.long)
        return Proposal(tokens, None, torch.tensor([len(t) for t in found], dtype=torch.long))

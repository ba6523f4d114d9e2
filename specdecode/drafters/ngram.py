"""Prompt-lookup (n-gram) drafting: copy what followed the latest earlier occurrence of the suffix.

No model, no state. Proposals are deterministic, so they are verified as point masses
(``Proposal.probs is None``), which keeps sampling exact.
"""

from __future__ import annotations

from typing import Sequence

import torch

from specdecode.drafters.base import DrafterBase, Proposal, SequenceView
from specdecode.verify.tree import DETERMINISTIC


def lookup(token_ids: list[int], k: int, max_ngram: int, min_ngram: int) -> list[int]:
    """Up to ``k`` tokens that followed the most recent earlier match of the longest suffix n-gram."""
    found = lookup_many(token_ids, k, max_ngram, min_ngram, 1)
    return found[0] if found else []


def lookup_many(token_ids: list[int], k: int, max_ngram: int, min_ngram: int, count: int) -> list[list[int]]:
    """Up to ``count`` distinct continuations (each up to ``k`` tokens): longest suffix n-gram first,
    then the latest match first."""
    n_tokens, out = len(token_ids), []
    for n in range(min(max_ngram, n_tokens - 1), min_ngram - 1, -1):
        suffix = token_ids[n_tokens - n :]
        for start in range(n_tokens - n - 1, -1, -1):  # latest match first, never the suffix itself
            if token_ids[start : start + n] == suffix:
                cont = token_ids[start + n : start + n + k]
                if cont and cont not in out:
                    out.append(cont)
                    if len(out) == count:
                        return out
    return out


class NgramDrafter(DrafterBase):
    """Chains, or with ``tree_topk > 1`` a trie of up to ``tree_topk`` continuations found in the
    text (at most ``tree_nodes`` nodes): deterministic siblings, verified by rule (c)."""

    name = "ngram"
    free = True  # a proposal costs no model forward: the selector may ask it for any sequence (selector._look)

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, tree_topk: int = 1, tree_nodes: int = 0) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        if tree_topk < 1 or (tree_topk > 1 and tree_nodes < 1):
            raise ValueError(f"need tree_topk >= 1 and, for trees, tree_nodes >= 1; got {tree_topk}, {tree_nodes}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.tree_topk, self.tree_nodes = tree_topk, tree_nodes
        self.max_tree_nodes = tree_nodes if tree_topk > 1 else 0

    def propose(self, seqs: Sequence[SequenceView], num_tokens: list[int]) -> Proposal:
        if self.tree_topk > 1:
            return self._propose_tree(seqs, num_tokens)
        found = [lookup(s.token_ids, k, self.max_ngram, self.min_ngram) if k else [] for s, k in zip(seqs, num_tokens)]
        tokens = torch.zeros(len(seqs), max(num_tokens, default=0), dtype=torch.long)
        for b, toks in enumerate(found):
            tokens[b, : len(toks)] = torch.tensor(toks, dtype=torch.long)
        return Proposal(tokens, None, torch.tensor([len(t) for t in found], dtype=torch.long))

    def _propose_tree(self, seqs: Sequence[SequenceView], num_tokens: list[int]) -> Proposal:
        tries = []
        for s, k in zip(seqs, num_tokens):
            conts = lookup_many(s.token_ids, k, self.max_ngram, self.min_ngram, self.tree_topk) if k else []
            tokens: list[int] = []
            parents: list[int] = []
            children: dict[tuple[int, int], int] = {}  # (parent, token) -> node
            for cont in conts:  # merge into a trie, most preferred continuation first
                node = -1
                for tok in cont:
                    if (node, tok) not in children:
                        if len(tokens) == self.tree_nodes:
                            break
                        children[(node, tok)] = len(tokens)
                        tokens.append(tok)
                        parents.append(node)
                    node = children[(node, tok)]
            tries.append((tokens, parents))
        width = max([len(t) for t, _ in tries] + [0])
        tokens_t = torch.zeros(len(seqs), width, dtype=torch.long)
        parents_t = torch.full((len(seqs), width), -1, dtype=torch.long)
        for b, (toks, pars) in enumerate(tries):
            tokens_t[b, : len(toks)] = torch.tensor(toks, dtype=torch.long)
            parents_t[b, : len(pars)] = torch.tensor(pars, dtype=torch.long)
        num = torch.tensor([len(t) for t, _ in tries], dtype=torch.long)
        return Proposal(tokens_t, None, num, parents_t, DETERMINISTIC)


def build(arg: str, ctx) -> NgramDrafter:
    """``--draft ngram`` (longest suffix 3 tokens) or ``ngram:MAX`` / ``ngram:MIN-MAX``."""
    tree = (ctx.config.tree_topk, ctx.config.tree_nodes)
    if not arg:
        return NgramDrafter(3, 1, *tree)
    lo, sep, hi = arg.partition("-")
    try:
        return NgramDrafter(int(hi), int(lo), *tree) if sep else NgramDrafter(int(lo), 1, *tree)
    except ValueError as exc:
        from specdecode.drafters import DraftSpecError

        raise DraftSpecError(
            f"bad n-gram drafter spec 'ngram:{arg}': use ngram, ngram:MAX or ngram:MIN-MAX ({exc})"
        ) from None

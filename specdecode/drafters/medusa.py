"""Medusa drafting (``--draft medusa:HEADS``): heads on the target's final hidden state propose the
tokens after the pending one — no second model, almost no cost.

The engine hands the drafter the target's final hidden state of every cached token
(``feature_layers = (FINAL,)``); the last one, ``h_t``, belongs to the token before the pending
token ``t + 1``, and head ``j`` proposes token ``t + j + 2`` from it (see
:mod:`specdecode.models.medusa`). Chains take each head's top-1 (``--draft-confidence P`` ends a
chain after a token its head gives less than ``P``: later heads are rarely right, and verifying them
costs); with ``--tree-topk K > 1`` the
drafter proposes Medusa's *static* tree of ``--tree-nodes`` nodes (head ``j``'s top-K tokens at
depth ``j + 1``, the nodes chosen once from the heads' held-out accuracy by rank).

Exact: proposals are deterministic, so chains verify as point masses and trees by rule (c) —
the output law is the target's. A request's logits processors (logit bias, penalties:
:mod:`specdecode.processors`) change head ``j``'s logits as the target's are changed at that position,
with the prefix of the heads' processed top-1 tokens before it (a tree ranks each head's tokens after that
same prefix: its other branches are proposals like any other, exact whatever they are). Typical acceptance (lossy, labelled) is a verifier choice
(:mod:`specdecode.verify.typical`), not the drafter's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch

from specdecode.drafters.autoregressive import check_tree, draft_settings, invariant_draws
from specdecode.drafters.base import DrafterBase, Proposal, SequenceView, TargetFeatures
from specdecode.models.base import FINAL, Runner
from specdecode.models.medusa import HeadsError, MedusaHeads, check_model, check_sizes, static_tree
from specdecode.processors import process_rows, processors_of
from specdecode.verify.tree import DETERMINISTIC


class MedusaDrafter(DrafterBase):
    name = "medusa"
    feature_layers = (FINAL,)

    def __init__(
        self,
        heads: MedusaHeads,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        tree_topk: int = 1,
        tree_nodes: int = 0,
        confidence: float = 0.0,
    ) -> None:
        check_tree(tree_topk, tree_nodes)
        self.heads = heads.to(device=device, dtype=dtype).eval().requires_grad_(False)
        self.num_heads = heads.config.num_heads
        self.tree_topk = tree_topk
        self.confidence = confidence  # chains end after a token its head gives less than this (0 = off)
        self.last: dict[int, tuple[int, torch.Tensor]] = {}  # slot -> (position, final hidden state)
        self.tree: tuple[list[int], list[int], list[int]] | None = None
        self.max_tree_nodes = 0
        if tree_topk > 1:
            accuracy = heads.config.accuracy or [[1.0 / (r + 2) for r in range(tree_topk)]] * self.num_heads
            self.tree = static_tree([row[:tree_topk] for row in accuracy], tree_nodes, self.num_heads)
            self.max_tree_nodes = len(self.tree[0])

    # -- state --------------------------------------------------------------------------------------
    def observe(self, slots: list[int], features: list[TargetFeatures]) -> None:
        for slot, f in zip(slots, features):
            if f.token_ids:
                self.last[slot] = (f.start + len(f.token_ids) - 1, f.hidden[FINAL][-1])

    def move(self, src: int, dst: int) -> None:
        if src in self.last:
            self.last[dst] = self.last.pop(src)

    def release(self, slot: int) -> None:
        self.last.pop(slot, None)

    # -- drafting -----------------------------------------------------------------------------------
    @torch.inference_mode()
    def _ranked(
        self, hidden: torch.Tensor, ranks: int, views: Sequence[SequenceView]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, H] -> ([B, num_heads, ranks] target ids best first, [B, num_heads] each head's top-1 probability)."""
        logits = self.heads(hidden.to(self.heads.out.weight.dtype)).float()
        if any(processors_of(v) for v in views):
            logits = self._processed(logits, views)  # over the target's vocabulary
            ids = None
        else:
            ids = self.heads.id_map
        top = logits.topk(ranks, dim=-1)
        top1_prob = torch.exp(top.values[..., 0] - torch.logsumexp(logits, dim=-1))
        return (top.indices if ids is None else ids[top.indices]).cpu(), top1_prob.cpu()

    def _processed(self, logits: torch.Tensor, views: Sequence[SequenceView]) -> torch.Tensor:
        """[B, num_heads, draft_vocab] -> [B, num_heads, V]: head ``j`` through each row's processors after the
        processed top-1 tokens of heads ``0 .. j-1``."""
        full = logits.new_full((*logits.shape[:-1], self.heads.config.vocab_size), -float("inf"))
        full[..., self.heads.id_map] = logits
        chain: list[list[int]] = [[] for _ in views]
        for j in range(full.shape[1]):
            full[:, j] = process_rows(views, full[:, j], chain)
            for row, tok in zip(chain, full[:, j].argmax(-1).tolist()):
                row.append(tok)
        return full

    def propose(self, seqs: Sequence[SequenceView], num_tokens: list[int]) -> Proposal:
        rows = []
        for b, (s, k) in enumerate(zip(seqs, num_tokens)):
            state = self.last.get(s.slot)
            if k > 0 and state is not None and state[0] == len(s.token_ids) - 2:  # h of the pending token's parent
                rows.append(b)
        if not rows:
            return Proposal.empty(len(seqs))
        hidden = torch.stack([self.last[seqs[b].slot][1] for b in rows])
        ranked, top1_prob = self._ranked(hidden, self.tree_topk, [seqs[b] for b in rows])
        if self.tree is None:
            return self._chains(len(seqs), rows, ranked, top1_prob, num_tokens)
        return self._trees(len(seqs), rows, ranked, num_tokens)

    def _chains(
        self, batch: int, rows: list[int], ranked: torch.Tensor, top1_prob: torch.Tensor, num_tokens: list[int]
    ) -> Proposal:
        width = min(self.num_heads, max(num_tokens))
        tokens = torch.zeros(batch, width, dtype=torch.long)
        num = torch.zeros(batch, dtype=torch.long)
        for r, b in enumerate(rows):
            n = min(num_tokens[b], self.num_heads)
            if self.confidence > 0:  # keep up to and including the first token its head is unsure of
                unsure = (top1_prob[r, :n] < self.confidence).nonzero()
                n = int(unsure[0]) + 1 if len(unsure) else n
            tokens[b, :n] = ranked[r, :n, 0]
            num[b] = n
        return Proposal(tokens, None, num)

    def _trees(self, batch: int, rows: list[int], ranked: torch.Tensor, num_tokens: list[int]) -> Proposal:
        assert self.tree is not None  # trees are proposed only when the drafter was built with one
        parents_all, depths, ranks = self.tree
        tokens = torch.zeros(batch, self.max_tree_nodes, dtype=torch.long)
        parents = torch.full((batch, self.max_tree_nodes), -1, dtype=torch.long)
        num = torch.zeros(batch, dtype=torch.long)
        for r, b in enumerate(rows):
            keep = [i for i, d in enumerate(depths) if d < num_tokens[b]]  # closed under parents (they are shallower)
            new_index = {old: new for new, old in enumerate(keep)}
            for new, old in enumerate(keep):
                tokens[b, new] = ranked[r, depths[old], ranks[old]]
                parents[b, new] = new_index[parents_all[old]] if parents_all[old] >= 0 else -1
            num[b] = len(keep)
        return Proposal(tokens, None, num, parents, DETERMINISTIC)


def check_target(heads: MedusaHeads, target: Runner, where: str) -> None:
    """Refuse heads trained for another target: sizes first, then the model fingerprint."""
    check_sizes("heads", "hidden states", heads.config, target, where)
    check_model("heads", heads.config, heads.id_map, target, where)


def validate(arg: str) -> None:
    """Cheap checks before any model loads: the spec names a heads directory."""
    from specdecode.models.medusa import WEIGHTS, require_dir

    if not arg:
        raise HeadsError(
            "draft spec 'medusa' needs the heads directory: medusa:DIR (train one with "
            "`specdecode heads train --kind medusa`)"
        )
    require_dir(Path(arg).expanduser(), WEIGHTS, "medusa", "a heads", f"medusa:{arg}: ")


def build(arg: str, ctx) -> MedusaDrafter:
    """``--draft medusa:DIR`` (a directory written by ``specdecode heads train``)."""
    validate(arg)
    heads = MedusaHeads.load(Path(arg))
    check_target(heads, ctx.target, arg)
    invariant_draws(heads, ctx.config)
    dtype = torch.float32 if str(ctx.target.device) == "cpu" else ctx.target.dtype
    return MedusaDrafter(heads, ctx.target.device, dtype, **draft_settings(ctx.config))

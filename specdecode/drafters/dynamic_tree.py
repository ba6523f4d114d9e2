"""Growing a draft tree level by level from an autoregressive drafter (EAGLE-2's dynamic tree, made exact).

Shared by drafters that can score many continuations per forward (the draft model; EAGLE). Per row:

* level 1: the root (the pending token) gets ``topk`` children from the drafter's distribution there;
* each later level: the ``topk`` nodes of the newest level with the highest cumulative draft
  log-probability are fed to the drafter (one forward for the whole batch, tree-masked) and each gets
  ``topk`` children, until the row's depth or the node budget ``max_nodes`` is reached.

Greedy rows take the ``topk`` most probable tokens (deterministic siblings, verification rule (c))
and, as EAGLE-2 does, grow past the budget (up to ``GROWTH`` times it) and then keep the
``max_nodes`` nodes of highest cumulative log-probability (an ancestor always scores at least as high
as its descendants, so the kept set is a tree): with greedy verification any choice of nodes is exact.
Sampled rows draw their children *without replacement* from the warped draft distribution (rule
(b)) and keep every drawn node: for sampled verification to stay exact a node's number of children
must be fixed before they are drawn, from the tree above it only, and a rerank would depend on the
children's own draws.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from specdecode.sampling import SamplingParams, sample, warp, warp_tensors


@dataclass
class GrownTree:
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)  # -1 = the root
    depths: list[int] = field(default_factory=list)  # 1 for the root's children
    scores: list[float] = field(default_factory=list)  # cumulative draft log-probability
    laws: list[torch.Tensor | None] = field(default_factory=list)  # [V] the law each node was drawn from
    # (None in an all-greedy batch, which is verified without them)
    fed: list[bool] = field(default_factory=list)  # its K/V was written by an expansion forward
    writes: list[int] = field(default_factory=list)  # where its K/V are (offset in the drafter's tree window)

    def ancestors_or_self(self, i: int) -> list[int]:
        out = []
        while i >= 0:
            out.append(i)
            i = self.parents[i]
        return out[::-1]

    def keep_best(self, budget: int) -> None:
        """Keep the ``budget`` nodes of highest score (ties: earlier nodes), re-indexed in order."""
        if len(self.tokens) <= budget:
            return
        keep = sorted(sorted(range(len(self.tokens)), key=lambda i: (-self.scores[i], i))[:budget])
        new = {old: j for j, old in enumerate(keep)}
        assert all(self.parents[i] < 0 or self.parents[i] in new for i in keep), "kept set must be a tree"
        for name in ("tokens", "depths", "scores", "laws", "fed", "writes"):
            values = getattr(self, name)
            setattr(self, name, [values[i] for i in keep])
        self.parents = [new[self.parents[i]] if self.parents[i] >= 0 else -1 for i in keep]


GROWTH = 4  # greedy trees grow up to this many times the node budget before the rerank

# expand(trees, nodes) -> [A, E, V] logits after each listed node (rows with no nodes: ignored)
ExpandFn = Callable[[list[GrownTree], list[list[int]]], torch.Tensor]


def grow_trees(
    root_logits: torch.Tensor,  # [A, V] the drafter's logits after each row's pending token
    params: list[SamplingParams],
    generators: list[torch.Generator],
    depths: list[int],
    topk: int,
    max_nodes: int,
    expand: ExpandFn,
) -> list[GrownTree]:
    trees = [GrownTree() for _ in params]
    warp_args = warp_tensors(params)  # [A] each: temperature, top_k, top_p (, min_p)
    caps = [max_nodes * GROWTH if p.greedy else max_nodes for p in params]  # nodes a row may grow to
    # an all-greedy batch is verified without draft laws: skip the vocabulary-sized one-hot per child
    laws_needed = not all(p.greedy for p in params)

    def add_children(logits: torch.Tensor, parent_of: list[tuple[int, int]]) -> None:
        """``logits`` [n, V] after the listed (row, parent node) pairs; draw each one's children."""
        rows = [r for r, _ in parent_of]
        laws = warp(logits, *(x[rows] for x in warp_args))  # [n, V]
        logp = torch.log_softmax(logits.float(), -1)
        for (r, parent), law, lp, raw in zip(parent_of, laws, logp, logits):
            tree = trees[r]
            m = min(topk, caps[r] - len(tree.tokens))
            if m <= 0:
                continue
            if params[r].greedy:
                vals, idx = raw.float().topk(m)
                kids = [int(x) for x, v in zip(idx, vals) if math.isfinite(float(v))]
                kid_laws = [
                    torch.zeros_like(law).index_fill_(0, torch.tensor([x], device=law.device), 1.0)
                    if laws_needed
                    else None
                    for x in kids
                ]
            else:  # m draws without replacement, with m uniforms from the row's generator
                u = torch.rand(m, generator=generators[r])
                remaining, kids = law.clone(), []
                for j in range(m):
                    if float(remaining.sum()) <= 0:
                        break
                    x = int(sample(remaining[None], u[j : j + 1])[0])
                    kids.append(x)
                    remaining[x] = 0.0
                kid_laws = [law] * len(kids)
            base = tree.scores[parent] if parent >= 0 else 0.0
            depth = tree.depths[parent] + 1 if parent >= 0 else 1
            score_of = lp if params[r].greedy else torch.log(law.clamp(min=1e-30))
            for x, kl in zip(kids, kid_laws):
                tree.writes.append(len(tree.tokens))
                tree.tokens.append(x)
                tree.parents.append(parent)
                tree.depths.append(depth)
                tree.scores.append(base + float(score_of[x]))
                tree.laws.append(kl)
                tree.fed.append(False)

    active = [r for r, d in enumerate(depths) if d > 0]
    if active:
        add_children(root_logits[active], [(r, -1) for r in active])
    level = 1
    while True:
        chosen: list[list[int]] = [[] for _ in trees]
        for r in range(len(trees)):
            tree = trees[r]
            if level >= depths[r] or len(tree.tokens) >= caps[r]:
                continue
            newest = [i for i, d in enumerate(tree.depths) if d == level]
            chosen[r] = sorted(newest, key=lambda i: -tree.scores[i])[:topk]
        if not any(chosen):
            for tree in trees:
                tree.keep_best(max_nodes)  # greedy rows only ever exceed the budget
            return trees
        logits = expand(trees, chosen)  # [A, E, V]
        for r, nodes in enumerate(chosen):
            for i in nodes:
                trees[r].fed[i] = True
        pairs = [(r, i) for r, nodes in enumerate(chosen) for i in nodes]
        flat = torch.stack([logits[r, e] for r, nodes in enumerate(chosen) for e in range(len(nodes))])
        add_children(flat, pairs)
        level += 1

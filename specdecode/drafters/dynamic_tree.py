"""Growing a draft tree level by level from an autoregressive drafter (EAGLE-2's dynamic tree, made exact).

Shared by drafters that can score many continuations per forward (the draft model; EAGLE). Per row:

* level 1: the root (the pending token) gets ``topk`` children from the drafter's distribution there;
* each later level: the ``topk`` nodes of the newest level with the highest cumulative draft
  log-probability are fed to the drafter (one forward for the whole batch, tree-masked) and each gets
  ``topk`` children, until the row's depth or the node budget ``max_nodes`` is reached.

Greedy rows take the ``topk`` most probable tokens (deterministic siblings, verification rule (c));
sampled rows draw their children *without replacement* from the warped draft distribution (rule (b)).
Every drawn node is kept: a node's number of children is fixed before they are drawn, from the
tree above it only, which is what keeps sampled verification exact (see :mod:`specdecode.verify.tree`).
EAGLE-2 instead reranks all candidates and keeps the best ``max_nodes``; that choice depends on the
children's own draws and is only exact for greedy decoding, so it is not used.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from specdecode.sampling import SamplingParams, params_tensors, sample, warp


@dataclass
class GrownTree:
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)  # -1 = the root
    depths: list[int] = field(default_factory=list)  # 1 for the root's children
    scores: list[float] = field(default_factory=list)  # cumulative draft log-probability
    laws: list[torch.Tensor] = field(default_factory=list)  # [V] the law each node was drawn from
    fed: list[bool] = field(default_factory=list)  # its K/V was written by an expansion forward

    def ancestors_or_self(self, i: int) -> list[int]:
        out = []
        while i >= 0:
            out.append(i)
            i = self.parents[i]
        return out[::-1]


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
    temperature, top_k, top_p = params_tensors(params)

    def add_children(logits: torch.Tensor, parent_of: list[tuple[int, int]]) -> None:
        """``logits`` [n, V] after the listed (row, parent node) pairs; draw each one's children."""
        rows = [r for r, _ in parent_of]
        laws = warp(logits, temperature[rows], top_k[rows], top_p[rows])  # [n, V]
        logp = torch.log_softmax(logits.float(), -1)
        for (r, parent), law, lp, raw in zip(parent_of, laws, logp, logits):
            tree = trees[r]
            m = min(topk, max_nodes - len(tree.tokens))
            if m <= 0:
                continue
            if params[r].greedy:
                vals, idx = raw.float().topk(m)
                kids = [int(x) for x, v in zip(idx, vals) if math.isfinite(float(v))]
                kid_laws = [torch.zeros_like(law).index_fill_(0, torch.tensor([x], device=law.device), 1.0)
                            for x in kids]
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
            if level >= depths[r] or len(tree.tokens) >= max_nodes:
                continue
            newest = [i for i, d in enumerate(tree.depths) if d == level]
            chosen[r] = sorted(newest, key=lambda i: -tree.scores[i])[:topk]
        if not any(chosen):
            return trees
        logits = expand(trees, chosen)  # [A, E, V]
        for r, nodes in enumerate(chosen):
            for i in nodes:
                trees[r].fed[i] = True
        pairs = [(r, i) for r, nodes in enumerate(chosen) for i in nodes]
        flat = torch.stack([logits[r, e] for r, nodes in enumerate(chosen) for e in range(len(nodes))])
        add_children(flat, pairs)
        level += 1

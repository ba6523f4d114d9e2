"""Pure verification of a batch of ragged draft *trees* (tensors in, tensors out; no model, no cache).

A row's tree is given as in :mod:`specdecode.tree`: node ``i`` (query ``i + 1`` of the forward) has
token ``tokens[b, i]`` and parent ``parents[b, i]`` (``-1`` = the root, the pending token, query 0);
``target_probs[b, q]`` / ``target_argmax[b, q]`` are the target's (warped) next-token distribution /
argmax after query ``q``; ``draft_probs[b, i]`` is the distribution node ``i`` was drawn from (its
parent's draft distribution, shared by all siblings; before any removal).

**Greedy** (:func:`verify_tree_greedy`): from the root, descend into the first child whose token is
the target's argmax at the current node; stop where none is. The emitted tokens are the accepted
path's tokens and then the target's argmax at its end: exactly what target-only greedy decoding
emits, so the longest root-to-leaf path matching the argmax chain is found.

**Sampled, exact** (:func:`verify_tree`): walk from the root. At each node, with ``p`` the target's
warped distribution there, test its children in order, each with a fresh uniform ``u``, by the rule
that matches how the siblings were drawn:

* ``IID`` (a) — siblings drawn i.i.d. from ``q``: accept ``x`` if ``u * q(x) < p(x)``; on rejection
  ``p <- norm(max(p - q, 0))``. This is SpecInfer's multi-round rejection (Miao et al. 2024): each
  sibling is one round of the chain rule against the residual left by the previous rounds.
* ``WITHOUT_REPLACEMENT`` (b) — siblings drawn without replacement from ``q``: as (a), and after a
  rejection also ``q <- norm(q with x removed)``, the law of the next sibling given the earlier ones
  (recursive rejection sampling, Jeon et al. 2024, "Recursive Speculative Decoding", Thm. 1).
* ``DETERMINISTIC`` (c) — siblings fixed by the drafter (top-k of a head, n-gram continuations):
  each is a point mass, so accept with ``p(x)``; on rejection ``p(x) <- 0`` and renormalise
  (the chain rule with ``q = δ_x``).

Why it is exact (one level; the tree follows by induction on the accepted child, whose subtree is
verified against a fresh ``p`` of the target at that child): a round accepts ``x`` with probability
``min(p(x), q(x))`` and otherwise leaves the residual ``r = norm(max(p - q, 0))`` as the law the
output must follow — the Leviathan/Chen identity ``min(p, q) + (1 - Σ min(p, q)) r = p``. Given a
rejection and the rejected tokens, the next sibling is a fresh draw from the stated sibling law,
so the next round is the same identity with ``r`` as target. If every child is rejected (or the node
has none), one token is sampled from the current ``p``: the residual, or the bonus distribution.
The number of children a node has may depend on anything drawn before those children (never on
their own values): the drafters here decide it before drawing.

Which drafter uses which rule: the draft model's sampled trees draw siblings without replacement
(b); its greedy trees, n-gram trees and Medusa heads are deterministic (c). Rule (a) is provided for
drafters that draw siblings independently. A tree of width 1 is a chain, and gives exactly the chain
verifier's result for the same uniforms.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdecode.sampling import sample

IID = "iid"
WITHOUT_REPLACEMENT = "without_replacement"
DETERMINISTIC = "deterministic"
RULES = (IID, WITHOUT_REPLACEMENT, DETERMINISTIC)


@dataclass
class TreeVerifyResult:
    tokens: torch.Tensor  # [B, D+1] long; row b emits tokens[b, : num_accepted[b] + 1]
    num_accepted: torch.Tensor  # [B] long: accepted nodes on the path (its depth)
    path: torch.Tensor  # [B, D+1] long query indices of the accepted path, root (0) first; -1 padded


def _children(parents: torch.Tensor, num_nodes: torch.Tensor) -> list[list[list[int]]]:
    """Per row, per query index, the child query indices in order."""
    out = []
    for row, n in zip(parents.tolist(), num_nodes.tolist()):
        kids: list[list[int]] = [[] for _ in range(len(row) + 1)]
        for i in range(n):
            kids[row[i] + 1].append(i + 1)
        out.append(kids)
    return out


def _result(paths: list[list[int]], emitted: list[list[int]], device) -> TreeVerifyResult:
    width = max(len(p) for p in paths)
    tokens = torch.zeros(len(paths), width, dtype=torch.long)
    path = torch.full((len(paths), width), -1, dtype=torch.long)
    for b, (p, e) in enumerate(zip(paths, emitted)):
        tokens[b, : len(e)] = torch.tensor(e)
        path[b, : len(p)] = torch.tensor(p)
    num = torch.tensor([len(p) - 1 for p in paths], dtype=torch.long)
    return TreeVerifyResult(tokens.to(device), num.to(device), path.to(device))


def verify_tree_greedy(
    tokens: torch.Tensor,  # [B, K]
    parents: torch.Tensor,  # [B, K]
    num_nodes: torch.Tensor,  # [B]
    target_argmax: torch.Tensor,  # [B, 1+K]
) -> TreeVerifyResult:
    kids = _children(parents, num_nodes)
    toks, argmax = tokens.tolist(), target_argmax.tolist()
    paths, emitted = [], []
    for b in range(len(kids)):
        node, path, out = 0, [0], []
        while True:
            want = argmax[b][node]
            nxt = next((c for c in kids[b][node] if toks[b][c - 1] == want), None)
            out.append(want)
            if nxt is None:
                break
            node = nxt
            path.append(node)
        paths.append(path)
        emitted.append(out)
    return _result(paths, emitted, tokens.device)


def _child_table(parents: torch.Tensor, num_nodes: torch.Tensor) -> torch.Tensor:  # [B, 1+K, C] query ids, -1 pad
    """Per row and query, its children's query indices in node order (vectorised over the batch)."""
    bsz, k = parents.shape
    dev = parents.device
    if k == 0:
        return torch.full((bsz, 1, 1), -1, dtype=torch.long, device=dev)
    idx = torch.arange(k, device=dev)
    valid = idx[None] < num_nodes.to(dev)[:, None]
    group = torch.where(valid, parents.to(dev) + 1, torch.full_like(parents, k + 1, device=dev))  # parent query
    order = torch.argsort(group * (k + 1) + idx[None], dim=1)  # by parent, then by node index
    grouped = group.gather(1, order)
    starts = torch.ones_like(grouped, dtype=torch.bool)
    starts[:, 1:] = grouped[:, 1:] != grouped[:, :-1]
    first = torch.cummax(torch.where(starts, idx[None].expand(bsz, -1), torch.zeros_like(grouped)), dim=1).values
    rank = idx[None] - first  # position among its siblings
    width = int(torch.where(valid.gather(1, order), rank, torch.zeros_like(rank)).max()) + 1
    table = torch.full((bsz, k + 2, width), -1, dtype=torch.long, device=dev)
    keep = valid.gather(1, order)
    rows = torch.arange(bsz, device=dev)[:, None].expand(-1, k)
    table[rows[keep], grouped[keep], rank[keep]] = (order + 1)[keep]
    return table[:, : k + 1]


def verify_tree(
    tokens: torch.Tensor,  # [B, K]
    parents: torch.Tensor,  # [B, K]
    num_nodes: torch.Tensor,  # [B]
    draft_probs: torch.Tensor | None,  # [B, K, V] the law each node was drawn from; None = point masses
    target_probs: torch.Tensor,  # [B, 1+K, V] warped target distributions after each query
    uniforms: torch.Tensor,  # [B, K+1]: [:, i] the test of node i, [:, K] the final draw
    rule: str,
) -> TreeVerifyResult:
    """The walk of the module docstring, for all rows at once: each round, every row still walking
    tests its next child (or, with none left, samples its final token), so at most K + 1 rounds."""
    if rule not in RULES:
        raise ValueError(f"unknown sibling rule {rule!r}: choose {', '.join(RULES)}")
    if draft_probs is None:
        rule = DETERMINISTIC
    elif rule == DETERMINISTIC:
        draft_probs = None
    bsz, k = tokens.shape
    dev = target_probs.device
    tokens, uniforms = tokens.to(dev), uniforms.to(dev)
    table = _child_table(parents, num_nodes).to(dev)  # [B, 1+K, C]
    rows = torch.arange(bsz, device=dev)
    node = torch.zeros(bsz, dtype=torch.long, device=dev)  # current query
    cursor = torch.zeros(bsz, dtype=torch.long, device=dev)  # next sibling to test
    fresh = target_probs[:, 0]  # [B, V] the target's law at the current node
    p, p_norm = fresh, fresh  # the residual (unnormalised, sampled from) and its normalised form (tested)
    q = None  # [B, V] the law of the next sibling (rules a, b)
    walking = torch.ones(bsz, dtype=torch.bool, device=dev)
    path = torch.full((bsz, k + 1), -1, dtype=torch.long, device=dev)
    path[:, 0] = 0
    out = torch.zeros(bsz, k + 1, dtype=torch.long, device=dev)
    depth = torch.zeros(bsz, dtype=torch.long, device=dev)
    while bool(walking.any()):
        child = table[rows, node, cursor.clamp(max=table.shape[2] - 1)]
        child = torch.where(cursor < table.shape[2], child, torch.full_like(child, -1))
        finish = walking & (child < 0)
        if bool(finish.any()):  # no child left: the residual, or the bonus distribution at a leaf
            final = sample(p, uniforms[:, k])
            out[rows, depth] = torch.where(finish, final, out[rows, depth])
            walking = walking & ~finish
        test = walking & (child >= 0)
        if not bool(test.any()):
            break
        node_idx = (child - 1).clamp(min=0)
        x = tokens[rows, node_idx]  # [B]
        u = uniforms[rows, node_idx]
        target_x = p_norm[rows, x]
        if rule == DETERMINISTIC:
            accept = u < target_x
        else:
            assert draft_probs is not None  # the random rules verify draft laws
            first = cursor == 0
            drawn_from = draft_probs[rows, node_idx]  # [B, V]
            if q is None or rule == IID:
                q = drawn_from
            else:
                q = torch.where(first[:, None], drawn_from, q)
            accept = u * q[rows, x] < target_x
        accept &= test
        reject = test & ~accept
        # accepted: descend, with the target's fresh law at the child
        out[rows, depth] = torch.where(accept, x, out[rows, depth])
        depth = depth + accept.long()
        path[rows, depth] = torch.where(accept, child, path[rows, depth])
        node = torch.where(accept, child, node)
        cursor = torch.where(accept, torch.zeros_like(cursor), cursor + reject.long())
        new_fresh = target_probs[rows, node]
        # rejected: the residual against the sibling law (rule c: zero the token)
        if rule == DETERMINISTIC:
            residual = p_norm.clone()
            residual[rows, x] = torch.where(reject, torch.zeros_like(target_x), residual[rows, x])
        else:
            assert q is not None  # set above, on every random rule's first step
            residual = (p_norm - q).clamp(min=0)
            if rule == WITHOUT_REPLACEMENT:
                removed = q.clone()
                removed[rows, x] = 0.0
                total = removed.sum(-1, keepdim=True)
                removed = torch.where(total > 0, removed / torch.where(total > 0, total, 1.0), removed)
                q = torch.where(reject[:, None], removed, q)
        total = residual.sum(-1, keepdim=True)
        empty = total <= 0  # only through rounding (a rejection of probability ~0): as the chain does
        residual = torch.where(empty, fresh, residual)
        total = torch.where(empty, fresh.sum(-1, keepdim=True), total)
        p = torch.where(accept[:, None], new_fresh, torch.where(reject[:, None], residual, p))
        p_norm = torch.where(accept[:, None], new_fresh, torch.where(reject[:, None], residual / total, p_norm))
        fresh = torch.where(accept[:, None], new_fresh, fresh)
    return TreeVerifyResult(out[:, : int(depth.max()) + 1], depth, path[:, : int(depth.max()) + 1])

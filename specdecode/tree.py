"""Tree-shaped proposals as one target forward: pure tensor layout, no model.

A proposal for row ``b`` is a tree of ``num_nodes[b]`` draft tokens hanging off the row's pending
token (the *root*, the last token of the sequence, not yet in the cache). Node ``i`` has parent
``parents[b, i]``: ``-1`` for the root, else an earlier node (``parents[b, i] < i``, so nodes come
in topological order). A chain is the special case ``parents[b, i] = i - 1``.

In the forward, query ``0`` is the root and query ``i + 1`` is node ``i``. Every query gets

* RoPE position ``start + depth`` (the position its token would have on its own path),
* K/V write index ``start + query index`` (distinct slots in the cache window, compacted later),
* visibility of the cached prefix and of its ancestors and itself (the tree mask),

so the logits of a node equal those of a plain chain forward over its root-to-node path. After
verification, :func:`path_writes` names the write indices of the accepted path, which the runner
compacts to ``start + 1, start + 2, ...`` (``Runner.compact``); the root is already at ``start``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TreeLayout:
    input_ids: torch.Tensor  # [B, 1+K] root token, then node tokens
    positions: torch.Tensor  # [B, 1+K] start + depth
    write_positions: torch.Tensor  # [B, 1+K] start + query index
    mask: torch.Tensor  # [B, 1+K, 1+K] bool: query i sees query j (ancestor-or-self)
    depth: torch.Tensor  # [B, 1+K] root 0; padding nodes 1


def chain_parents(batch: int, k: int) -> torch.Tensor:  # [B, K]: node i hangs off node i - 1
    return (torch.arange(k) - 1)[None].expand(batch, -1).clone()


def tree_layout(
    root_ids: torch.Tensor,  # [B] the pending token of each row
    tokens: torch.Tensor,  # [B, K] node tokens, padded past num_nodes
    parents: torch.Tensor,  # [B, K] parent node index, -1 = the root; padded past num_nodes
    num_nodes: torch.Tensor,  # [B] valid nodes per row
    start: torch.Tensor,  # [B] position of the root (= cached length of the row)
) -> TreeLayout:
    bsz, k = tokens.shape
    device = tokens.device
    parents = parents.to(device=device, dtype=torch.long)
    num_nodes, start = num_nodes.to(device), start.to(device)
    valid = torch.arange(k, device=device)[None] < num_nodes[:, None]  # [B, K]
    if bool((valid & ((parents < -1) | (parents >= torch.arange(k, device=device)[None]))).any()):
        raise ValueError("tree parents must be -1 (the root) or an earlier node index")
    parent_q = torch.where(valid, parents + 1, torch.zeros_like(parents))  # padding hangs off the root

    q = k + 1
    mask = torch.zeros(bsz, q, q, dtype=torch.bool, device=device)
    mask[:, 0, 0] = True
    depth = torch.zeros(bsz, q, dtype=torch.long, device=device)
    rows = torch.arange(bsz, device=device)
    for i in range(k):
        mask[:, i + 1] = mask[rows, parent_q[:, i]]
        mask[:, i + 1, i + 1] = True
        depth[:, i + 1] = depth[rows, parent_q[:, i]] + 1

    ar = torch.arange(q, device=device)[None]
    return TreeLayout(
        input_ids=torch.cat([root_ids.to(device)[:, None], tokens], dim=1),
        positions=start[:, None] + depth,
        write_positions=start[:, None] + ar,
        mask=mask,
        depth=depth,
    )


def root_to_leaf_paths(layout: TreeLayout, num_nodes: torch.Tensor) -> list[list[list[int]]]:
    """Per row, the query indices of every root-to-leaf path (root first), for inspection and tests
    (the retrieve indices of Medusa/EAGLE; the engine itself never needs them)."""
    out = []
    for b, n in enumerate(num_nodes.tolist()):
        parents_q = {0}
        for q in range(1, n + 1):
            parents_q.add(int(layout.mask[b, q, :q].nonzero().flatten()[-1]))  # its deepest proper ancestor
        leaves = [q for q in range(n + 1) if q not in parents_q] or [0]
        out.append([layout.mask[b, leaf, : n + 1].nonzero().flatten().tolist() for leaf in leaves])
    return out


def path_writes(start: int, path: list[int]) -> list[int]:
    """Write indices of a path's nodes after the root (``path`` as query indices, root first)."""
    return [start + i for i in path[1:]]

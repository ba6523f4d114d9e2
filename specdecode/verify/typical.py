"""Typical acceptance (Medusa, Cai et al. 2024) — **LOSSY**: the output no longer follows the target's law.

A draft token ``x`` proposed after a position whose warped target distribution is ``p`` is accepted
when ``p(x) > min(epsilon, alpha * exp(-H(p)))``: plausible tokens pass even where exact rejection
sampling would often reject them, so more tokens are accepted per step, and the output is biased
towards the drafter's choices. After the accepted prefix (chain) or the deepest accepted path
(tree; the first in node order on ties), one token is sampled from ``p`` at its end — never a
residual. Greedy requests never come here: the engine verifies all-greedy batches by argmax match,
which typical acceptance reduces to at temperature 0.

Engines built with this verifier mark every output ``"lossy": true`` and name the acceptance
(``specdecode.build``); ``specdecode check`` reports FAIL on them, as it must.
"""

from __future__ import annotations

from functools import partial

import torch

from specdecode.sampling import sample
from specdecode.verify.chain import VerifyResult
from specdecode.verify.tree import TreeVerifyResult

EPSILON = 0.09  # Medusa's posterior_threshold
ALPHA = 0.3  # Medusa's posterior_alpha (= sqrt(epsilon))


def _passes(probs: torch.Tensor, tokens: torch.Tensor, epsilon: float, alpha: float) -> torch.Tensor:
    """probs [..., V], tokens [...] -> [...] bool: the typical test."""
    entropy = -(probs * torch.log(probs.clamp(min=1e-10))).sum(-1)
    threshold = torch.clamp(alpha * torch.exp(-entropy), max=epsilon)
    return probs.gather(-1, tokens[..., None]).squeeze(-1) > threshold


def verify_typical(
    draft_tokens: torch.Tensor,  # [B, K]
    draft_probs: torch.Tensor | None,  # unused: typical acceptance looks at the target only
    target_probs: torch.Tensor,  # [B, K+1, V]
    num_draft: torch.Tensor,  # [B]
    uniforms: torch.Tensor,  # [B, K+1]: only [:, K] (the final draw) is used
    *,
    epsilon: float = EPSILON,
    alpha: float = ALPHA,
) -> VerifyResult:
    bsz, k = draft_tokens.shape
    rows = torch.arange(bsz, device=draft_tokens.device)
    valid = torch.arange(k, device=draft_tokens.device)[None, :] < num_draft[:, None]
    ok = _passes(target_probs[:, :k], draft_tokens, epsilon, alpha) & valid if k else valid
    num_accepted = ok.long().cumprod(dim=1).sum(dim=1)
    final = sample(target_probs[rows, num_accepted], uniforms[:, k])
    tokens = torch.cat([draft_tokens, torch.zeros(bsz, 1, dtype=draft_tokens.dtype, device=draft_tokens.device)], 1)
    tokens[rows, num_accepted] = final
    return VerifyResult(tokens, num_accepted)


def verify_tree_typical(
    tokens: torch.Tensor,  # [B, K]
    parents: torch.Tensor,  # [B, K]
    num_nodes: torch.Tensor,  # [B]
    draft_probs: torch.Tensor | None,  # unused
    target_probs: torch.Tensor,  # [B, 1+K, V]
    uniforms: torch.Tensor,  # [B, K+1]: only [:, K] is used
    rule: str | None = None,  # unused: siblings need no rule here
    *,
    epsilon: float = EPSILON,
    alpha: float = ALPHA,
) -> TreeVerifyResult:
    bsz, k = tokens.shape
    dev = target_probs.device
    paths, emitted = [], []
    par = parents.tolist()
    if k:
        parent_query = (parents + 1).clamp(min=0).to(dev)  # the query whose distribution node i is tested against
        probs_at = target_probs.gather(1, parent_query[:, :, None].expand(-1, -1, target_probs.shape[-1]))
        passed = _passes(probs_at, tokens.to(dev), epsilon, alpha).tolist()
    for b in range(bsz):
        ok = [False] * k
        depth = [0] * k
        best, best_depth = -1, 0
        for i in range(int(num_nodes[b])):
            parent_ok = par[b][i] < 0 or ok[par[b][i]]
            ok[i] = parent_ok and passed[b][i]
            if ok[i]:
                depth[i] = 1 + (depth[par[b][i]] if par[b][i] >= 0 else 0)
                if depth[i] > best_depth:
                    best, best_depth = i, depth[i]
        path, node = [], best
        while node >= 0:
            path.append(node + 1)
            node = par[b][node]
        paths.append([0] + path[::-1])
        emitted.append([int(tokens[b, q - 1]) for q in paths[-1][1:]])
    ends = torch.tensor([p[-1] for p in paths], device=dev)
    finals = sample(target_probs[torch.arange(bsz, device=dev), ends], uniforms[:, k].to(dev)).tolist()
    width = max(len(p) for p in paths)
    out = torch.zeros(bsz, width, dtype=torch.long)
    path_t = torch.full((bsz, width), -1, dtype=torch.long)
    for b in range(bsz):
        seq = emitted[b] + [finals[b]]
        out[b, : len(seq)] = torch.tensor(seq)
        path_t[b, : len(paths[b])] = torch.tensor(paths[b])
    num = torch.tensor([len(p) - 1 for p in paths])
    return TreeVerifyResult(out.to(dev), num.to(dev), path_t.to(dev))


def typical_verifier(epsilon: float = EPSILON, alpha: float = ALPHA):
    """A :class:`specdecode.verify.Verifier` with typical acceptance for sampled requests (LOSSY)."""
    from specdecode.verify import Verifier

    if not (0 < epsilon <= 1 and alpha > 0):
        raise ValueError(f"typical acceptance needs 0 < epsilon <= 1 and alpha > 0, got {epsilon}, {alpha}")
    return Verifier(
        speculative=partial(verify_typical, epsilon=epsilon, alpha=alpha),
        tree=partial(verify_tree_typical, epsilon=epsilon, alpha=alpha),
    )

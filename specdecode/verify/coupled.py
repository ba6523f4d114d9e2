"""Pure verification for the coupled sampler (``--sampler coupled``): drafter-invariant sampling.

Every position is sampled by Gumbel-max in its exponential-race form: the token at absolute position
``n`` of a request seeded ``s`` is ``argmax(target_probs / E)`` with ``E = race_noise(s, n)`` (one
``Exp(1)`` per token, a function of (seed, position) alone; :mod:`specdecode.sampling`). That is an exact
sample of the warped target law at that position, and target-only decoding emits exactly these tokens.

A drafter proposes with the *same* noise on its own law (``argmax(draft_probs / E)``: a point mass
given the seed), or any other way. The target accepts a draft token iff its own choice at that
position is that token; at the first mismatch it emits its own choice (the *corrected* token); when
every draft token is accepted, its choice at the next position (the *bonus* token). So a step emits
exactly the target's choices along its accepted path: the output is target-only coupled decoding's,
token for token, whatever drafted, how many tokens, in a tree or a chain, in any batch — provided the
target's probabilities at a position do not depend on the verify width or the batch (the engine's
batch-invariant mode; otherwise only where rounding flips a near-tie of ``probs / E``).

Acceptance: the draft and the target choose the same token with probability at least
``(1 - TV) / (1 + TV)`` (Daliri et al. 2025, "coupling without communication") against rejection
sampling's ``1 - TV``; never more than rejection sampling, about the same where the laws are close.

Trees: at each node the child equal to the target's choice there, if any, is accepted (siblings hold
distinct tokens, so at most one can be); the choice depends only on the node's depth, since the noise
is keyed by absolute position. This is greedy tree verification on the coupled choices.
"""

from __future__ import annotations

import torch

from specdecode.sampling import coupled_choice
from specdecode.verify.chain import VerifyResult, verify_greedy
from specdecode.verify.tree import TreeVerifyResult, verify_tree_greedy


def verify_coupled(
    draft_tokens: torch.Tensor,  # [B, K]
    target_probs: torch.Tensor,  # [B, K+1, V] warped target distributions at the verified positions
    noise: torch.Tensor,  # [B, K+1, V] race noise of those positions (row b: its seed, position len_b + j)
    num_draft: torch.Tensor,  # [B]
) -> VerifyResult:
    """Accept while the draft equals the target's coupled choice; emit the choices up to the first mismatch."""
    choice = coupled_choice(target_probs, noise)  # [B, K+1]
    return verify_greedy(draft_tokens, choice, num_draft)


def verify_tree_coupled(
    tokens: torch.Tensor,  # [B, K]
    parents: torch.Tensor,  # [B, K] (-1 = the root, the pending token)
    num_nodes: torch.Tensor,  # [B]
    target_probs: torch.Tensor,  # [B, 1+K, V] warped target distributions after each query
    noise: torch.Tensor,  # [B, D+1, V] race noise after a query of depth d: row b's position len_b + d
    depth: torch.Tensor,  # [B, 1+K] each query's depth (root 0)
) -> TreeVerifyResult:
    """From the root, descend into the child equal to the target's coupled choice at the current node."""
    rows = torch.arange(depth.shape[0], device=depth.device)[:, None].expand_as(depth)
    choice = coupled_choice(target_probs, noise.to(target_probs.device)[rows, depth.clamp(max=noise.shape[1] - 1)])
    return verify_tree_greedy(tokens, parents, num_nodes, choice)

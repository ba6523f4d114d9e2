"""Pure verification of a chain of draft tokens (tensors in, tensors out; no model, no cache).

Terms (per row, Leviathan et al. 2023 / Chen et al. 2023):

* *accepted* tokens: the longest prefix of the draft that passes the acceptance test;
* *recovered* token: at the first rejection, a sample from the normalised residual
  ``max(0, target_probs - draft_probs)``;
* *bonus* token: when every draft token is accepted, a sample from the target distribution at the
  next position.

Each row emits ``num_accepted + 1`` tokens: its accepted prefix, then one recovered or bonus token.
Rows may have different draft lengths (``num_draft``); positions at or past a row's draft length are
ignored.

Exactness: with ``draft_probs`` the distribution the draft token was sampled from, the emitted
tokens follow ``target_probs`` exactly. A drafter that proposes deterministically (n-gram lookup,
greedy heads) passes ``draft_probs=None``: a point mass, for which the acceptance probability is
``target_probs[x]`` and the residual is ``target_probs`` with ``x`` removed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdecode.sampling import sample


@dataclass
class VerifyResult:
    tokens: torch.Tensor  # [B, K+1] long; row b's emitted tokens are tokens[b, : num_accepted[b] + 1]
    num_accepted: torch.Tensor  # [B] long, 0 <= num_accepted[b] <= num_draft[b]


def _leading_true(mask: torch.Tensor) -> torch.Tensor:  # [B, K] bool -> [B] count of leading Trues
    return mask.long().cumprod(dim=1).sum(dim=1)


def _valid(num_draft: torch.Tensor, k: int) -> torch.Tensor:  # [B, K] bool: position < num_draft
    return torch.arange(k, device=num_draft.device)[None, :] < num_draft[:, None]


def verify_greedy(
    draft_tokens: torch.Tensor,  # [B, K]
    target_argmax: torch.Tensor,  # [B, K+1] argmax of the target logits at each verified position
    num_draft: torch.Tensor,  # [B]
) -> VerifyResult:
    """Greedy verification: accept while the draft equals the target's argmax.

    Accepted draft tokens equal the target argmax, so the emitted tokens are exactly the first
    ``num_accepted + 1`` target argmax tokens.
    """
    k = draft_tokens.shape[1]
    match = (draft_tokens == target_argmax[:, :k]) & _valid(num_draft, k)
    return VerifyResult(tokens=target_argmax.clone(), num_accepted=_leading_true(match))


def verify_speculative(
    draft_tokens: torch.Tensor,  # [B, K]
    draft_probs: torch.Tensor | None,  # [B, K, V] warped draft distributions, or None (point mass)
    target_probs: torch.Tensor,  # [B, K+1, V] warped target distributions
    num_draft: torch.Tensor,  # [B]
    uniforms: torch.Tensor,  # [B, K+1] in [0, 1): [:, :K] acceptance draws, [:, K] the final-token draw
) -> VerifyResult:
    """Exact speculative sampling (rejection sampling against the draft distribution)."""
    bsz, k = draft_tokens.shape
    rows = torch.arange(bsz, device=draft_tokens.device)
    idx = draft_tokens[:, :, None]
    target_at_draft = target_probs[:, :k].gather(2, idx).squeeze(2)  # [B, K]
    if draft_probs is None:
        draft_at_draft = torch.ones_like(target_at_draft)
    else:
        draft_at_draft = draft_probs.gather(2, idx).squeeze(2)  # [B, K]
    # u < min(1, p_target / p_draft)  <=>  u * p_draft < p_target   (no division, p_draft may be 0)
    accept = (uniforms[:, :k] * draft_at_draft < target_at_draft) & _valid(num_draft, k)
    num_accepted = _leading_true(accept)  # [B]

    final_target = target_probs[rows, num_accepted]  # [B, V]
    rejected = num_accepted < num_draft  # [B]: a recovered token is needed (else a bonus token)
    pos = num_accepted.clamp(max=max(k - 1, 0))
    if k == 0:
        final_probs = final_target
    elif draft_probs is None:
        point = torch.zeros_like(final_target).scatter_(1, draft_tokens[rows, pos][:, None], 1.0)
        residual = (final_target - point).clamp_(min=0)
        final_probs = torch.where(rejected[:, None], residual, final_target)
    else:
        residual = (final_target - draft_probs[rows, pos]).clamp_(min=0)
        final_probs = torch.where(rejected[:, None], residual, final_target)
    # A residual can vanish only through rounding when target == draft at that position (then the
    # rejection had probability ~0); fall back to the target distribution rather than divide by 0.
    empty = final_probs.sum(-1) <= 0
    final_probs = torch.where(empty[:, None], final_target, final_probs)
    final_token = sample(final_probs, uniforms[:, k])

    tokens = torch.cat([draft_tokens, torch.zeros(bsz, 1, dtype=draft_tokens.dtype, device=draft_tokens.device)], dim=1)
    tokens[rows, num_accepted] = final_token
    return VerifyResult(tokens=tokens, num_accepted=num_accepted)

"""Log-probabilities of the emitted tokens (OpenAI's ``logprobs`` / ``top_logprobs``), read from the
target's verify pass.

The law. The log-probability reported for a token emitted at a position whose history is ``h`` is

    log_softmax(process(logits_target(h), h) / T)[token]

where ``process`` is the request's logits processors (logit bias, penalties: :mod:`specdecode.processors`)
and ``T`` its temperature (``T = 1`` for greedy, ``temperature == 0``): the distribution the request
samples from *before truncation* (top-k, top-p, min-p). With no truncation it is exactly the law the
token was sampled from; with truncation it is the law the truncation is applied to, so a token outside
the kept set still has a finite value (OpenAI never reports ``-inf``). A token masked by a processor
(a ``-inf`` logit) has ``-inf``; it is never emitted, and is never listed among the top entries.
The values are always the target's (never the draft's), for every emitted token, accepted draft,
bonus or corrected token alike: under speculation the target's logits at every verified position are
already computed, processed with the drafted prefix of that position (which is the history the token
really has once the prefix is accepted), so they are taken from there, with no extra forward; a
request that asks for none costs nothing (:meth:`Engine._logprobs` runs only for rows that ask).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LOGPROBS_MAX = 20  # the most top entries a request may ask for (OpenAI's top_logprobs range: 0..20)


@dataclass(frozen=True)
class TokenLogprob:
    """One emitted token: its id, its log-probability under the law above, and the ``top`` most likely
    tokens of that law as (id, log-probability), most likely first (as many as asked, finite ones only)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def law_logprobs(logits: torch.Tensor, temperature: float) -> torch.Tensor:  # [P, V] -> [P, V] float32
    """The reported law's log-probabilities of processed logits (module docstring): temperature only."""
    scaled = logits.float()
    if temperature > 0:
        scaled = scaled / temperature  # the same division as sampling.warp
    return torch.log_softmax(scaled, dim=-1)


def token_logprobs(
    logits: torch.Tensor,  # [P, V] processed logits of the positions the tokens were emitted at
    tokens: list[int],  # [P] the emitted tokens
    temperature: float,
    top_n: int,
) -> list[TokenLogprob]:
    """Each emitted token's :class:`TokenLogprob` under the law of the module docstring."""
    if not tokens:
        return []
    lp = law_logprobs(logits, temperature)  # [P, V]
    index = torch.tensor(tokens, dtype=torch.long, device=lp.device)[:, None]
    chosen = lp.gather(1, index)[:, 0].tolist()
    if top_n <= 0:
        return [TokenLogprob(t, c) for t, c in zip(tokens, chosen)]
    values, ids = lp.topk(min(top_n, lp.shape[-1]), dim=-1)  # [P, N], most likely first
    out = []
    for t, c, vs, ix in zip(tokens, chosen, values.tolist(), ids.tolist()):
        out.append(TokenLogprob(t, c, tuple((i, v) for i, v in zip(ix, vs) if v > -float("inf"))))
    return out

"""Where to look: the real contexts in which a wrong verification rule would show most.

A context where both models are sure of the next token tells nothing about the verifier (every rule
emits that token); the first run on the real pair showed exactly that at the end of a code prompt.
So parts 1 and 2 use prefixes of the prompts chosen by their *visibility*: with the target and draft
next-token distributions at temperature 1 (``target``, ``draft``), the total-variation distance
between the correct law (``target``) and the law each of three canonical wrong rules would emit:

* accept every draft token: ``draft``;
* resample from the target instead of the residual: ``min(target, draft) + (1 - acceptance) target``;
* accept only the target's argmax ``a`` (greedy acceptance, temperature ignored):
  ``draft[a] delta_a + (1 - draft[a]) target``;

and the visibility of a context is the smallest of the three, so every chosen context can expose
each of them. One target and one draft forward over each prompt score all its prefixes at once. The
choice depends only on the models' distributions, never on the verifier's draws, so the tests'
false-alarm bounds hold.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MIN_CONTEXT = 3  # tokens


@dataclass
class Context:
    prompt: int  # index of the prompt it is a prefix of
    token_ids: list[int]
    visibility: float | None  # min TV(correct law, wrong rule's law) at T=1; None: not scored

    def to_dict(self) -> dict:
        return {"prompt": self.prompt, "tokens": len(self.token_ids), "visibility_t1": self.visibility}


def rank_contexts(engine, prompts: list[list[int]], on_prompt=None) -> list[Context]:
    """Prefixes of ``prompts``, most informative first: each prompt's most visible prefix, in
    decreasing visibility, then each prompt's second best, and so on. Without a draft model in the target's
    vocabulary (n-gram drafting, a cross-vocabulary draft) the prompts themselves, in order."""
    draft_runner = engine.runners().get("draft")
    if draft_runner is None:
        return [Context(i, list(p), None) for i, p in enumerate(prompts)]
    per_prompt = []
    for i, prompt in enumerate(prompts):
        vis = visibility(*_next_token_probs(engine.target, draft_runner, prompt))  # [len]: after prefix 0..t
        first = min(MIN_CONTEXT, len(prompt)) - 1
        order = sorted(range(first, len(prompt)), key=lambda t: -vis[t])
        per_prompt.append([Context(i, prompt[: t + 1], float(vis[t])) for t in order])
        if on_prompt is not None:
            on_prompt()
    ranked = []
    for rank in range(max(len(c) for c in per_prompt)):
        row = [c[rank] for c in per_prompt if rank < len(c)]
        ranked += sorted(row, key=lambda c: -c.visibility)
    return ranked


def visibility(target: torch.Tensor, draft: torch.Tensor) -> torch.Tensor:  # [N, V] x2 -> [N]
    """Smallest TV distance between ``target`` and what the three canonical wrong rules emit."""
    overlap = torch.minimum(target, draft)
    acceptance = overlap.sum(-1, keepdim=True)  # [N, 1]
    accept_all = 0.5 * (draft - target).abs().sum(-1)
    skip_residual = 0.5 * (overlap - acceptance * target).abs().sum(-1)
    a = target.argmax(-1, keepdim=True)
    greedy_accept = draft.gather(-1, a)[:, 0] * (1 - target.gather(-1, a)[:, 0])
    return torch.minimum(torch.minimum(accept_all, skip_residual), greedy_accept)


@torch.inference_mode()
def _next_token_probs(target, draft, prompt: list[int]) -> tuple[torch.Tensor, torch.Tensor]:  # [len, V] x2
    ids = torch.tensor([prompt])
    positions = torch.arange(len(prompt))[None]
    probs = []
    for runner in (target, draft):
        logits = runner.logits(runner.forward(torch.tensor([0]), ids, positions).hidden)[0].cpu()  # [len, V]
        probs.append(logits.softmax(-1))
    vocab = min(p.shape[-1] for p in probs)  # a draft may pad its embedding rows differently
    return probs[0][:, :vocab], probs[1][:, :vocab]

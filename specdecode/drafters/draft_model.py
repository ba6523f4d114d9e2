"""Drafting with a separate (smaller) causal LM sharing the target's vocabulary."""

from __future__ import annotations

from typing import Sequence

import torch

from specdecode.drafters.base import DrafterBase, Proposal, SequenceView, common_prefix
from specdecode.models.base import Runner
from specdecode.sampling import params_tensors, sample, warp


class DraftModelDrafter(DrafterBase):
    """Samples ``k`` tokens autoregressively from a draft model, warped like the target.

    Per slot it remembers which tokens its KV cache holds (``_cached``); before drafting it rolls
    back to the part that still agrees with the sequence and feeds the rest (one token after a
    rejection, two when every draft token was accepted: the last draft token and the bonus token).

    ``confidence`` > 0 ends a sequence's chain early, after the first token whose draft probability
    is below it (greedy: the softmax of the draft logits; sampling: the warped distribution it was
    drawn from). That token is still proposed. The decision uses only the draft's own state, so
    verification stays exact; it saves draft steps (and verify width) where the draft is unsure.
    """

    name = "draft-model"

    def __init__(self, runner: Runner, vocab_size: int | None = None, confidence: float = 0.0) -> None:
        if not 0.0 <= confidence < 1.0:
            raise ValueError(f"draft confidence threshold must be in [0, 1), got {confidence!r}")
        self.confidence = confidence
        self.runner = runner
        # the target's vocabulary size: draft logits past it are never sampled, and the draft
        # distribution is zero-padded up to it when the draft's embedding matrix is smaller
        self.vocab_size = vocab_size or runner.vocab_size
        self._cached: dict[int, list[int]] = {}
        self._floor: dict[int, int] = {}  # a length known to agree with the sequence

    def reserve(self, num_slots: int, max_len: int) -> None:
        self.runner.ensure_capacity(num_slots, max_len)

    def runners(self) -> dict[str, Runner]:
        return {"draft": self.runner}

    def start(self, slots: list[int], prompts: list[list[int]]) -> None:
        self.runner.prefill(slots, [p[:-1] for p in prompts])
        for slot, p in zip(slots, prompts):
            self._cached[slot] = list(p[:-1])
            self._floor[slot] = len(p) - 1

    def move(self, src: int, dst: int) -> None:
        self.runner.copy_slot(src, dst, len(self._cached[src]))
        self._cached[dst] = self._cached.pop(src)
        self._floor[dst] = self._floor.pop(src)

    def release(self, slot: int) -> None:
        self._cached.pop(slot, None)
        self._floor.pop(slot, None)

    @torch.inference_mode()
    def propose(self, seqs: Sequence[SequenceView], num_tokens: list[int]) -> Proposal:
        bsz, k_max, dev = len(seqs), max(num_tokens, default=0), self.runner.device
        tokens = torch.zeros(bsz, k_max, dtype=torch.long, device=dev)
        probs = None
        rows = [b for b in range(bsz) if num_tokens[b] > 0]
        if not rows:
            return Proposal(tokens, None, torch.tensor(num_tokens, dtype=torch.long))
        active = [seqs[b] for b in rows]
        ks = [num_tokens[b] for b in rows]

        # 1. roll back to the agreeing prefix and feed what the cache lacks (ragged, right-padded)
        pending = []
        for s in active:
            keep = common_prefix(self._cached[s.slot], s.token_ids, self._floor[s.slot])
            if keep < len(self._cached[s.slot]):
                self.runner.truncate(s.slot, keep)
            pending.append((keep, s.token_ids[keep:]))
        width = max(len(p) for _, p in pending)
        ids = torch.zeros(len(active), width, dtype=torch.long)
        positions = torch.zeros(len(active), width, dtype=torch.long)
        for i, (keep, p) in enumerate(pending):
            ids[i, : len(p)] = torch.tensor(p)
            positions[i] = keep + torch.arange(width)  # padding continues the positions
        last = torch.tensor([len(p) - 1 for _, p in pending])
        slots = torch.tensor([s.slot for s in active])
        hidden = self.runner.forward(slots, ids, positions).hidden[torch.arange(len(active)), last.to(self.runner.device)]

        # 2. sample k tokens autoregressively with each sequence's own generator
        params = [s.params for s in active]
        temperature, top_k, top_p = params_tensors(params)
        all_greedy = all(p.greedy for p in params)
        uniforms = torch.zeros(len(active), k_max)
        for i, s in enumerate(active):
            if not s.params.greedy:
                uniforms[i, : ks[i]] = torch.rand(ks[i], generator=s.generator)
        step_probs = []
        next_pos = torch.tensor([len(s.token_ids) for s in active])
        j = 0
        while j < max(ks):
            logits = self._fit_vocab(self.runner.logits(hidden))  # [b, V]
            if all_greedy:
                tok = logits.argmax(-1)
            else:
                p = warp(logits, temperature, top_k, top_p)
                tok = sample(p, uniforms[:, j])
                step_probs.append(p)
            tokens[rows, j] = tok
            if self.confidence > 0:
                ks = self._stop_unsure(ks, j, logits, None if all_greedy else p, tok, params)
            j += 1
            if j < max(ks):
                hidden = self.runner.forward(slots, tok[:, None], (next_pos + j - 1)[:, None]).hidden[:, 0]

        # 3. remember what the cache now holds (the last proposed token was never fed)
        for i, s in enumerate(active):
            fed = tokens[rows[i], : ks[i] - 1].tolist()
            self._cached[s.slot] = s.token_ids + fed
            self._floor[s.slot] = len(s.token_ids)
        num = list(num_tokens)
        for i, b in enumerate(rows):
            num[b] = ks[i]
        width = max(num)
        if not all_greedy:
            probs = torch.zeros(bsz, width, step_probs[0].shape[-1], device=dev)
            probs[rows] = torch.stack(step_probs[:width], dim=1)
        return Proposal(tokens[:, :width], probs, torch.tensor(num, dtype=torch.long))

    def _stop_unsure(self, ks: list[int], j: int, logits: torch.Tensor, probs: torch.Tensor | None,
                     tok: torch.Tensor, params) -> list[int]:
        """End the chain of each row whose j-th token has draft probability below the threshold:
        the warped probability it was sampled with, or for greedy rows the draft's softmax."""
        greedy = torch.tensor([p.greedy for p in params], device=logits.device)
        conf = probs.gather(1, tok[:, None])[:, 0] if probs is not None else torch.zeros(len(params), device=logits.device)
        if greedy.any():
            soft = torch.softmax(logits[greedy], dim=-1).gather(1, tok[greedy, None])[:, 0]
            conf[greedy] = soft
        return [j + 1 if j < k and c < self.confidence else k for k, c in zip(ks, conf.tolist())]

    def _fit_vocab(self, logits: torch.Tensor) -> torch.Tensor:  # [b, V_draft] -> [b, V_target]
        extra = self.vocab_size - logits.shape[-1]
        if extra > 0:
            return torch.nn.functional.pad(logits, (0, extra), value=-float("inf"))
        return logits[..., : self.vocab_size]


def build(arg: str, ctx) -> DraftModelDrafter:
    """``--draft MODEL`` (or ``model:MODEL``): the draft model ``ctx`` loaded for ``arg``."""
    return DraftModelDrafter(ctx.draft_runner(), ctx.target.vocab_size, ctx.config.draft_confidence)

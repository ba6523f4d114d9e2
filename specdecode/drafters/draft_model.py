"""Drafting with a separate (smaller) causal LM sharing the target's vocabulary: chains, or with
``tree_topk > 1`` dynamic trees (:mod:`specdecode.drafters.dynamic_tree`)."""

from __future__ import annotations

import time
from typing import Callable, Sequence

import torch

from specdecode.drafters.base import DrafterBase, Proposal, SequenceView, common_prefix
from specdecode.drafters.dynamic_tree import GROWTH, GrownTree, grow_trees
from specdecode.models.base import Runner
from specdecode.models.device import synchronize
from specdecode.sampling import params_tensors, sample, warp
from specdecode.verify.tree import DETERMINISTIC, WITHOUT_REPLACEMENT


CATCH_UP_WIDTH = 16  # a row with more tokens to read than this reads them through the runner's prefill


class DraftModelDrafter(DrafterBase):
    """Samples ``k`` tokens autoregressively from a draft model, warped like the target.

    Per slot it remembers which tokens its KV cache holds (``_cached``); before drafting it rolls
    back to the part that still agrees with the sequence and feeds the rest (one token after a
    rejection, two when every draft token was accepted: the last draft token and the bonus token).

    ``confidence`` > 0 ends a sequence's chain early, after the first token whose draft probability
    is below it (greedy: the softmax of the draft logits; sampling: the warped distribution it was
    drawn from). That token is still proposed. The decision uses only the draft's own state, so
    verification stays exact; it saves draft steps (and verify width) where the draft is unsure.

    ``tree_topk > 1`` proposes a tree instead: ``tree_topk`` children per expanded node, at most
    ``tree_nodes`` nodes, depth = the requested draft length. Tree nodes' K/V are written past the
    sequence in the draft cache; at the next ``propose`` the branch the target accepted is compacted
    into place (``Runner.compact``) instead of being fed again.
    """

    name = "draft-model"
    lazy_start = True  # its state is the tokens it has read: it can start late and catch up (drafters.multi)
    # told of each backlog a proposal first read through prefill (tokens, seconds): the multi-drafter
    # reports it as catch-up, apart from the proposal's own time
    on_catch_up: Callable[[int, float], None] = staticmethod(lambda tokens, seconds: None)

    def __init__(self, runner: Runner, vocab_size: int | None = None, confidence: float = 0.0,
                 tree_topk: int = 1, tree_nodes: int = 0) -> None:
        if not 0.0 <= confidence < 1.0:
            raise ValueError(f"draft confidence threshold must be in [0, 1), got {confidence!r}")
        if tree_topk < 1 or (tree_topk > 1 and tree_nodes < 1):
            raise ValueError(f"need tree_topk >= 1 and, for trees, tree_nodes >= 1; got {tree_topk}, {tree_nodes}")
        self.confidence = confidence
        self.tree_topk, self.tree_nodes = tree_topk, tree_nodes
        self.max_tree_nodes = tree_nodes if tree_topk > 1 else 0
        self._tree: dict[int, tuple[int, GrownTree]] = {}  # slot -> (window start, the tree last proposed)
        self.runner = runner
        # the target's vocabulary size: draft logits past it are never sampled, and the draft
        # distribution is zero-padded up to it when the draft's embedding matrix is smaller
        self.vocab_size = vocab_size or runner.vocab_size
        self._cached: dict[int, list[int]] = {}
        self._floor: dict[int, int] = {}  # a length known to agree with the sequence

    def reserve(self, num_slots: int, max_len: int) -> None:
        # greedy trees grow past the node budget before their rerank: room for that window too
        extra = GROWTH * self.tree_nodes + 1 if self.tree_topk > 1 else 0
        self.runner.ensure_capacity(num_slots, max_len + extra)

    def runners(self) -> dict[str, Runner]:
        return {"draft": self.runner}

    def prefill(self, slots: list[int], pieces: list[list[int]], starts: list[int]) -> bool:
        self.runner.prefill(slots, pieces, starts=starts)
        for slot, piece, start in zip(slots, pieces, starts):
            self._cached[slot] = self._cached.get(slot, [])[:start] + list(piece)
            self._floor[slot] = len(self._cached[slot])
        return True

    def start(self, slots: list[int], prompts: list[list[int]]) -> None:
        # what ``prefill`` cached of a prompt (in pieces) is kept; the rest is prefilled now
        have = [common_prefix(self._cached.get(slot, []), p[:-1]) for slot, p in zip(slots, prompts)]
        self.runner.prefill(slots, [p[h:-1] for p, h in zip(prompts, have)], starts=have)
        for slot, p in zip(slots, prompts):
            self._cached[slot] = list(p[:-1])
            self._floor[slot] = len(p) - 1

    def move(self, src: int, dst: int) -> None:
        self.runner.copy_slot(src, dst, len(self._cached[src]))
        self._cached[dst] = self._cached.pop(src)
        self._floor[dst] = self._floor.pop(src)
        self._tree.pop(src, None)  # its nodes were not copied: the accepted branch is fed again instead

    def lag(self, seq: SequenceView) -> int:
        """Tokens the next proposal for ``seq`` must read beyond the usual one or two (the last draft
        token and the bonus token): what was generated while another drafter drafted for it."""
        cached = self._cached.get(seq.slot, [])
        return max(0, len(seq.token_ids) - common_prefix(cached, seq.token_ids, self._floor.get(seq.slot, 0)) - 2)

    def read(self, seqs: Sequence[SequenceView], budget: int) -> int:
        """Read up to ``budget`` tokens, in all, of the history the cache lacks (sequences in the order given),
        without drafting: a late start caught up on in pieces over several steps (the selector's
        ``catch_up_tokens``). Up to the pending token, which a proposal feeds. Returns the tokens read."""
        slots, pieces, starts = [], [], []
        for s in seqs:
            self._adopt_tree(s)
            cached = self._cached.setdefault(s.slot, [])  # (a slot first seen here has read nothing)
            keep = common_prefix(cached, s.token_ids, self._floor.setdefault(s.slot, 0))
            n = min(len(s.token_ids) - 1 - keep, budget)
            if keep < len(cached):
                self.runner.truncate(s.slot, keep)
                self._cached[s.slot] = cached[:keep]
            if n <= 0:
                continue
            slots.append(s.slot)
            pieces.append(s.token_ids[keep: keep + n])
            starts.append(keep)
            budget -= n
        if not slots:
            return 0
        t0 = time.perf_counter()
        self.prefill(slots, pieces, starts)
        synchronize(self.runner)
        tokens = sum(map(len, pieces))
        self.on_catch_up(tokens, time.perf_counter() - t0)
        return tokens

    def release(self, slot: int) -> None:
        self._cached.pop(slot, None)
        self._floor.pop(slot, None)
        self._tree.pop(slot, None)

    @torch.inference_mode()
    def _catch_up(self, active: Sequence[SequenceView]) -> torch.Tensor:  # [A, H] hidden after each pending token
        """Roll each slot back to the part of its cache that agrees with the sequence and feed the rest
        (ragged, right-padded), ending with the pending token."""
        pending = []
        long = []  # (slot, keep, tokens to prefill): rows far behind catch up in prefill-sized pieces first
        for s in active:
            self._adopt_tree(s)
            keep = common_prefix(self._cached[s.slot], s.token_ids, self._floor[s.slot])
            if keep < len(self._cached[s.slot]):
                self.runner.truncate(s.slot, keep)
            if len(s.token_ids) - keep > CATCH_UP_WIDTH:
                long.append((s.slot, keep, s.token_ids[keep:-1]))
                keep = len(s.token_ids) - 1
            pending.append((keep, s.token_ids[keep:]))
        if long:
            t0 = time.perf_counter()
            self.runner.prefill([slot for slot, _, _ in long], [p for _, _, p in long], starts=[k for _, k, _ in long])
            synchronize(self.runner)
            self.on_catch_up(sum(len(p) for _, _, p in long), time.perf_counter() - t0)
        width = max(len(p) for _, p in pending)
        ids = torch.zeros(len(active), width, dtype=torch.long)
        positions = torch.zeros(len(active), width, dtype=torch.long)
        for i, (keep, p) in enumerate(pending):
            ids[i, : len(p)] = torch.tensor(p)
            # padding continues the positions, clamped into the cache (its last index never holds valid data)
            positions[i] = (keep + torch.arange(width)).clamp(max=self.runner.max_len - 1)
        last = torch.tensor([len(p) - 1 for _, p in pending])
        slots = torch.tensor([s.slot for s in active])
        return self.runner.forward(slots, ids, positions).hidden[torch.arange(len(active)), last.to(self.runner.device)]

    def _adopt_tree(self, s: SequenceView) -> None:
        """Compact the K/V of the branch of the last tree that the sequence went on with."""
        record = self._tree.pop(s.slot, None)
        if record is None:
            return
        start, tree = record
        node, matched = -1, []
        for tok in s.token_ids[start:]:
            child = next((i for i, (t, p) in enumerate(zip(tree.tokens, tree.parents))
                          if p == node and t == tok and tree.fed[i]), None)
            if child is None:
                break
            matched.append(child)
            node = child
        if matched and self._cached[s.slot][:start] == s.token_ids[:start]:
            self.runner.compact(s.slot, [start + tree.writes[i] for i in matched], start)
            self._cached[s.slot] = s.token_ids[: start + len(matched)]

    @torch.inference_mode()
    def propose(self, seqs: Sequence[SequenceView], num_tokens: list[int]) -> Proposal:
        if self.tree_topk > 1:
            return self._propose_tree(seqs, num_tokens)
        bsz, k_max, dev = len(seqs), max(num_tokens, default=0), self.runner.device
        tokens = torch.zeros(bsz, k_max, dtype=torch.long, device=dev)
        probs = None
        rows = [b for b in range(bsz) if num_tokens[b] > 0]
        if not rows:
            return Proposal(tokens, None, torch.tensor(num_tokens, dtype=torch.long))
        active = [seqs[b] for b in rows]
        ks = [num_tokens[b] for b in rows]

        # 1. roll back to the agreeing prefix and feed what the cache lacks, up to the pending token
        hidden = self._catch_up(active)
        slots = torch.tensor([s.slot for s in active])

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
                ks = stop_unsure(ks, j, logits, None if all_greedy else p, tok, params, self.confidence)
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

    @torch.inference_mode()
    def _propose_tree(self, seqs: Sequence[SequenceView], num_tokens: list[int]) -> Proposal:
        bsz, dev = len(seqs), self.runner.device
        rows = [b for b in range(bsz) if num_tokens[b] > 0]
        if not rows:
            return Proposal.empty(bsz)
        active = [seqs[b] for b in rows]
        root_logits = self._fit_vocab(self.runner.logits(self._catch_up(active)))  # [A, V]
        starts = [len(s.token_ids) for s in active]  # tree node i is written at start + i
        slots = torch.tensor([s.slot for s in active])

        def expand(trees: list[GrownTree], chosen: list[list[int]]) -> torch.Tensor:  # [A, E, V]
            e_max, width = max(len(c) for c in chosen), max(len(t.tokens) for t in trees)
            ids = torch.zeros(len(trees), e_max, dtype=torch.long)
            positions = torch.zeros(len(trees), e_max, dtype=torch.long)
            writes = torch.zeros(len(trees), e_max, dtype=torch.long)
            mask = torch.zeros(len(trees), e_max, width, dtype=torch.bool)
            for r, (tree, nodes) in enumerate(zip(trees, chosen)):
                if not nodes:  # nothing to expand: a harmless write past any tree node, seeing the prefix
                    positions[r], writes[r] = starts[r], starts[r] + GROWTH * self.tree_nodes
                    continue
                for e in range(e_max):
                    i = nodes[min(e, len(nodes) - 1)]  # padding repeats the last node (same K/V, same place)
                    ids[r, e], writes[r, e] = tree.tokens[i], starts[r] + tree.writes[i]
                    positions[r, e] = starts[r] - 1 + tree.depths[i]
                    mask[r, e, tree.ancestors_or_self(i)] = True
            out = self.runner.forward(slots, ids, positions, write_positions=writes, tree_mask=mask,
                                      tree_start=torch.tensor(starts))
            return self._fit_vocab(self.runner.logits(out.hidden))

        trees = grow_trees(root_logits, [s.params for s in active], [s.generator for s in active],
                           [num_tokens[b] for b in rows], self.tree_topk, self.tree_nodes, expand)
        for s, start, tree in zip(active, starts, trees):
            self._cached[s.slot], self._floor[s.slot] = list(s.token_ids), start
            self._tree[s.slot] = (start, tree)
        return tree_proposal(bsz, rows, trees, all(s.params.greedy for s in active), dev)

    def _fit_vocab(self, logits: torch.Tensor) -> torch.Tensor:  # [b, V_draft] -> [b, V_target]
        extra = self.vocab_size - logits.shape[-1]
        if extra > 0:
            return torch.nn.functional.pad(logits, (0, extra), value=-float("inf"))
        return logits[..., : self.vocab_size]


def stop_unsure(ks: list[int], j: int, logits: torch.Tensor, probs: torch.Tensor | None, tok: torch.Tensor, params,
                threshold: float) -> list[int]:
    """End the chain of each row whose j-th token has draft probability below ``threshold``: the
    warped probability it was sampled with, or for greedy rows the draft's softmax."""
    greedy = torch.tensor([p.greedy for p in params], device=logits.device)
    conf = probs.gather(1, tok[:, None])[:, 0] if probs is not None else torch.zeros(len(params), device=logits.device)
    if greedy.any():
        soft = torch.softmax(logits[greedy], dim=-1).gather(1, tok[greedy, None])[:, 0]
        conf[greedy] = soft
    return [j + 1 if j < k and c < threshold else k for k, c in zip(ks, conf.tolist())]


def tree_proposal(bsz: int, rows: list[int], trees: list[GrownTree], greedy: bool, device) -> Proposal:
    """Pack grown trees (of batch rows ``rows``) into a tree :class:`Proposal`."""
    width = max(1, max(len(t.tokens) for t in trees))
    tokens = torch.zeros(bsz, width, dtype=torch.long)
    parents = torch.full((bsz, width), -1, dtype=torch.long)
    num = torch.zeros(bsz, dtype=torch.long)
    vocab = None if greedy else next((t.laws[0].shape[-1] for t in trees if t.laws), None)
    probs = None if vocab is None else torch.zeros(bsz, width, vocab, device=device)
    for b, tree in zip(rows, trees):
        n = len(tree.tokens)
        num[b] = n
        if n:
            tokens[b, :n] = torch.tensor(tree.tokens)
            parents[b, :n] = torch.tensor(tree.parents)
            if probs is not None:
                probs[b, :n] = torch.stack(tree.laws)
    rule = DETERMINISTIC if greedy else WITHOUT_REPLACEMENT
    return Proposal(tokens.to(device), probs, num.to(device), parents.to(device), rule)


def build(arg: str, ctx) -> DraftModelDrafter:
    """``--draft MODEL`` (or ``model:MODEL``): the draft model ``ctx`` loaded for ``arg``; a dynamic
    tree with ``--tree-topk K > 1``."""
    cfg = ctx.config
    return DraftModelDrafter(ctx.draft_runner(), ctx.target.vocab_size, cfg.draft_confidence,
                             getattr(cfg, "tree_topk", 1), getattr(cfg, "tree_nodes", 0))

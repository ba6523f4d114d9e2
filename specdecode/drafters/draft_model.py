"""Drafting with a separate (smaller) causal LM sharing the target's vocabulary: chains, or with
``tree_topk > 1`` dynamic trees (:mod:`specdecode.drafters.dynamic_tree`)."""

from __future__ import annotations

import time
from typing import Callable, Sequence

import torch

from specdecode.drafters.autoregressive import (
    AutoregressiveDrafter,
    draft_settings,
    grow_tree,
    propose_chain,
    tree_proposal,
)
from specdecode.drafters.base import Proposal, SequenceView, common_prefix
from specdecode.drafters.dynamic_tree import GrownTree
from specdecode.drafters.window import FimMarkers, WindowedRunner, draft_view
from specdecode.prefix_cache import RunnerPrefixCache
from specdecode.models.base import Runner
from specdecode.models.device import synchronize


CATCH_UP_WIDTH = 16  # a row with more tokens to read than this reads them through the runner's prefill


class DraftModelDrafter(AutoregressiveDrafter):
    """Samples ``k`` tokens autoregressively from a draft model, warped like the target (the loop:
    :mod:`specdecode.drafters.autoregressive`).

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

    ``context`` > 0 bounds what the draft reads of a prompt to about ``context`` tokens, its last ones, or for
    a fill-in-the-middle prompt (``fim``: the markers' ids) the code around the cursor
    (:mod:`specdecode.drafters.window`): every prompt token counts as read (``_cached`` holds them), and the
    draft runner is addressed through a :class:`WindowedRunner` that holds each slot's view.
    """

    name = "draft-model"
    lazy_start = True  # its state is the tokens it has read: it can start late and catch up (drafters.multi)
    # told of each backlog a proposal first read through prefill (tokens, seconds): the multi-drafter
    # reports it as catch-up, apart from the proposal's own time
    on_catch_up: Callable[[int, float], None] = staticmethod(lambda tokens, seconds: None)

    def __init__(
        self,
        runner: Runner,
        vocab_size: int | None = None,
        confidence: float = 0.0,
        tree_topk: int = 1,
        tree_nodes: int = 0,
        context: int = 0,
        fim: FimMarkers | None = None,
    ) -> None:
        super().__init__(confidence, tree_topk, tree_nodes)
        if context < 0:
            raise ValueError(f"draft context must be >= 0 (0: the whole prompt), got {context}")
        self.context = context
        # what positions go through: shifted into each slot's view (unchanged without a bound)
        self._kv = WindowedRunner(runner, context, fim)
        self._tree: dict[int, tuple[int, GrownTree]] = {}  # slot -> (window start, the tree last proposed)
        self.runner = runner
        # the target's vocabulary size: draft logits past it are never sampled, and the draft
        # distribution is zero-padded up to it when the draft's embedding matrix is smaller
        self.vocab_size = vocab_size or runner.vocab_size
        self._cached: dict[int, list[int]] = {}
        self._floor: dict[int, int] = {}  # a length known to agree with the sequence
        self.prefixes: RunnerPrefixCache | None = None  # finished sequences' KV (keep_prefixes)

    def keep_prefixes(self, budget: Callable[[Runner], int]) -> None:
        if RunnerPrefixCache.supported(self.runner):
            self.prefixes = RunnerPrefixCache(self.runner, budget(self.runner))

    def kept_bytes(self) -> int:
        return self.prefixes.index.nbytes if self.prefixes is not None else 0

    def restore(self, slot: int, tokens: list[int]) -> int:
        """A slot first seen with ``tokens``: the part of them it need not read, i.e. the tokens before its
        window (:mod:`specdecode.drafters.window`) and then the longest kept prefix of the window (0: a slot
        that holds something already, or nothing to skip)."""
        if self._cached.get(slot):
            return 0
        view = self._kv.begin(slot, tokens)
        n = len(tokens) - len(view)  # (the prompt tokens the view leaves out count as read)
        if self.prefixes is not None:  # (a kept prefix of the view: the draft's cache holds views)
            n += self.prefixes.restore(slot, view, len(view) - 1)
        if n:
            self._cached[slot], self._floor[slot] = list(tokens[:n]), n
        return n

    def runners(self) -> dict[str, Runner]:
        return {"draft": self.runner}

    def prefill(self, slots: list[int], pieces: list[list[int]], starts: list[int]) -> bool:
        self._kv.prefill(slots, pieces, starts=starts)
        for slot, piece, start in zip(slots, pieces, starts):
            self._cached[slot] = self._cached.get(slot, [])[:start] + list(piece)
            self._floor[slot] = len(self._cached[slot])
        return True

    def start(self, slots: list[int], prompts: list[list[int]]) -> None:
        # what ``prefill`` cached of a prompt (in pieces), or the prefix cache held, is kept; the rest is prefilled now
        for slot, p in zip(slots, prompts):
            self.restore(slot, p)
        have = [common_prefix(self._cached.get(slot, []), p[:-1]) for slot, p in zip(slots, prompts)]
        self._kv.prefill(slots, [p[h:-1] for p, h in zip(prompts, have)], starts=have)
        for slot, p in zip(slots, prompts):
            self._cached[slot] = list(p[:-1])
            self._floor[slot] = len(p) - 1

    def move(self, src: int, dst: int) -> None:
        self._kv.copy_slot(src, dst, len(self._cached[src]))
        self._cached[dst] = self._cached.pop(src)
        self._floor[dst] = self._floor.pop(src)
        self._tree.pop(src, None)  # its nodes were not copied: the accepted branch is fed again instead

    def lag(self, seq: SequenceView) -> int:
        """Tokens the next proposal for ``seq`` must read beyond the usual one or two (the last draft
        token and the bonus token): what was generated while another drafter drafted for it."""
        cached = self._cached.get(seq.slot, [])
        # a slot not seen yet will skip what its view leaves out
        skip = 0
        if self.context and seq.slot not in self._cached:
            skip = len(seq.token_ids) - len(draft_view(seq.token_ids, self.context, self._kv.fim))
        read = max(skip, common_prefix(cached, seq.token_ids, self._floor.get(seq.slot, 0)))
        return max(0, len(seq.token_ids) - read - 2)

    def read(self, seqs: Sequence[SequenceView], budget: int) -> int:
        """Read up to ``budget`` tokens, in all, of the history the cache lacks (sequences in the order given),
        without drafting: a late start caught up on in pieces over several steps (the selector's
        ``catch_up_tokens``). Up to the pending token, which a proposal feeds. Returns the tokens read."""
        slots, pieces, starts = [], [], []
        for s in seqs:
            self._adopt_tree(s)
            self.restore(s.slot, s.token_ids)  # a slot first seen here: from the longest kept prefix
            cached = self._cached.setdefault(s.slot, [])  # (a slot first seen here has read nothing)
            keep = common_prefix(cached, s.token_ids, self._floor.setdefault(s.slot, 0))
            n = min(len(s.token_ids) - 1 - keep, budget)
            if keep < len(cached):
                self._kv.truncate(s.slot, keep)
                self._cached[s.slot] = cached[:keep]
            if n <= 0:
                continue
            slots.append(s.slot)
            pieces.append(s.token_ids[keep : keep + n])
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
        if self.prefixes is not None and slot not in self._tree and self._cached.get(slot):
            self.prefixes.save(slot, self._kv.held(slot, self._cached[slot]))  # for the next prompt
        self._kv.release(slot)
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
                self._kv.truncate(s.slot, keep)
            if len(s.token_ids) - keep > CATCH_UP_WIDTH:
                long.append((s.slot, keep, s.token_ids[keep:-1]))
                keep = len(s.token_ids) - 1
            pending.append((keep, s.token_ids[keep:]))
        if long:
            t0 = time.perf_counter()
            self._kv.prefill([slot for slot, _, _ in long], [p for _, _, p in long], starts=[k for _, k, _ in long])
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
        return self._kv.forward(slots, ids, positions).hidden[torch.arange(len(active)), last.to(self.runner.device)]

    def _adopt_tree(self, s: SequenceView) -> None:
        """Compact the K/V of the branch of the last tree that the sequence went on with."""
        record = self._tree.pop(s.slot, None)
        if record is None:
            return
        start, tree = record
        node, matched = -1, []
        for tok in s.token_ids[start:]:
            child = next(
                (
                    i
                    for i, (t, p) in enumerate(zip(tree.tokens, tree.parents))
                    if p == node and t == tok and tree.fed[i]
                ),
                None,
            )
            if child is None:
                break
            matched.append(child)
            node = child
        if matched and self._cached[s.slot][:start] == s.token_ids[:start]:
            self._kv.compact(s.slot, [start + tree.writes[i] for i in matched], start)
            self._cached[s.slot] = s.token_ids[: start + len(matched)]

    @torch.inference_mode()
    def propose(self, seqs: Sequence[SequenceView], num_tokens: list[int]) -> Proposal:
        if self.tree_topk > 1:
            return self._propose_tree(seqs, num_tokens)
        bsz = len(seqs)
        rows = [b for b in range(bsz) if num_tokens[b] > 0]
        if not rows:
            tokens = torch.zeros(bsz, max(num_tokens, default=0), dtype=torch.long, device=self.runner.device)
            return Proposal(tokens, None, torch.tensor(num_tokens, dtype=torch.long))
        active = [seqs[b] for b in rows]
        # roll back to the agreeing prefix and feed what the cache lacks, up to the pending token
        hidden = self._catch_up(active)  # [A, H]
        slots = torch.tensor([s.slot for s in active])
        starts = torch.tensor([len(s.token_ids) for s in active])  # where the first draft token goes

        def feed(tok: torch.Tensor, j: int) -> torch.Tensor:  # the j-th draft token [A] -> logits after it [A, V]
            return self._logits(self._kv.forward(slots, tok[:, None], (starts + j)[:, None]).hidden[:, 0])

        proposal = propose_chain(bsz, rows, active, num_tokens, self._logits(hidden), feed, self.confidence)
        # remember what the cache now holds (the last proposed token was never fed)
        for b, s in zip(rows, active):
            fed = proposal.tokens[b, : int(proposal.num_tokens[b]) - 1].tolist()
            self._cached[s.slot] = s.token_ids + fed
            self._floor[s.slot] = len(s.token_ids)
        return proposal

    @torch.inference_mode()
    def _propose_tree(self, seqs: Sequence[SequenceView], num_tokens: list[int]) -> Proposal:
        bsz, dev = len(seqs), self.runner.device
        rows = [b for b in range(bsz) if num_tokens[b] > 0]
        if not rows:
            return Proposal.empty(bsz)
        active = [seqs[b] for b in rows]
        root_logits = self._logits(self._catch_up(active))  # [A, V]
        starts = [len(s.token_ids) for s in active]  # tree node i is written at start + i
        slots = torch.tensor([s.slot for s in active])

        def forward(trees, chosen, ids: torch.Tensor, positions: torch.Tensor, **tree) -> torch.Tensor:  # [A, E, V]
            return self._logits(self._kv.forward(slots, ids, positions, **tree).hidden)

        trees = grow_tree(
            active, [num_tokens[b] for b in rows], root_logits, starts, self.tree_topk, self.tree_nodes, forward
        )
        for s, start, tree in zip(active, starts, trees):
            self._cached[s.slot], self._floor[s.slot] = list(s.token_ids), start
            self._tree[s.slot] = (start, tree)
        return tree_proposal(bsz, rows, trees, all(s.params.greedy for s in active), dev)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., V_target]
        """The draft's logits over the target's vocabulary: past the draft's rows -inf, past the target's cut."""
        logits = self.runner.logits(hidden)
        extra = self.vocab_size - logits.shape[-1]
        if extra > 0:
            return torch.nn.functional.pad(logits, (0, extra), value=-float("inf"))
        return logits[..., : self.vocab_size]


def build(arg: str, ctx) -> DraftModelDrafter:
    """``--draft MODEL`` (or ``model:MODEL``): the draft model ``ctx`` loaded for ``arg``; a dynamic
    tree with ``--tree-topk K > 1``."""
    config = ctx.config
    assert config is not None  # (DraftContext fills in the defaults)
    fim = None
    if config.draft_context and ctx.tokenizer is not None:  # a FIM prompt keeps the code around the cursor
        from specdecode.fim import FimUnsupported, fim_tokens

        try:
            markers = fim_tokens(ctx.tokenizer)
            fim = (markers.prefix, markers.suffix, markers.middle)
        except FimUnsupported:
            pass
    return DraftModelDrafter(
        ctx.draft_runner(), ctx.target.vocab_size, **draft_settings(config), context=config.draft_context, fim=fim
    )

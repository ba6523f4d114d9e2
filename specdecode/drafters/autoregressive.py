"""The draft loop of the autoregressive drafters (the draft model, EAGLE), written once.

Each drafter keeps its own part: how it catches up on the sequence, what one draft step feeds (a
token; EAGLE also a feature) and how its state is kept. It hands this module the logits after each
row's pending token and a function that feeds one step; the loop does the rest, the same for both:

A request's logits processors (:mod:`specdecode.processors`: logit bias, penalties) change the draft's
logits at each drafted position exactly as the target's are changed there, with the drafted prefix so
far (a chain's tokens before the position; a tree node's path), before anything is warped or ranked.

* **chains** (:func:`propose_chain`): ``k`` steps; each step's logits are warped with the request's
  :class:`~specdecode.sampling.SamplingParams`, each row samples with its own generator (uniforms drawn
  up front, ``k`` per sampled row) or takes the argmax, and the tokens and the laws they were drawn from
  are collected; a row of the coupled sampler (``--sampler coupled``) takes ``argmax(law / E)`` with the
  noise ``E`` of the token's absolute position (:func:`specdecode.sampling.race_noise`), the target's own
  noise there, and draws nothing. ``confidence > 0`` ends a row's chain after its first token whose draft probability is
  below it (:func:`stop_unsure`): the decision reads only the draft's state, so verification stays exact.
* **trees** (:func:`grow_tree`): EAGLE-2's dynamic tree, grown level by level
  (:func:`specdecode.drafters.dynamic_tree.grow_trees`); each level is one tree-masked forward whose
  inputs are built here, its nodes' K/V written past the sequence (node ``i`` at ``start + i``). A
  coupled row grows as a greedy row over its noise-perturbed log-law ``log(law / E)``: a node's
  children are the top of ``law / E`` at their position (Gumbel top-k: distinct tokens, the first
  the coupled choice).

:class:`AutoregressiveDrafter` holds the settings both take (``--draft-confidence``, ``--tree-topk``,
``--tree-nodes``) and sizes the draft cache for the tree window; :func:`draft_settings` reads them
from the engine config, and :func:`invariant_draws` applies ``--batch-invariant``, for every drafter
with a model of its own (Medusa's heads too).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Sequence, cast

import torch

from specdecode.config import DraftSettings
from specdecode.drafters.base import DrafterBase, Proposal, SequenceView
from specdecode.drafters.dynamic_tree import GROWTH, GrownTree, grow_trees
from specdecode.models.base import Runner
from specdecode.processors import process_batch, process_rows, processors_of
from specdecode.sampling import coupled_choice, greedy_tokens, race_noise, sample, warp, warp_tensors
from specdecode.verify.tree import DETERMINISTIC, WITHOUT_REPLACEMENT

# feed(tokens [A], j) -> logits [A, V]: feed each row's j-th draft token, return the logits after it
FeedFn = Callable[[torch.Tensor, int], torch.Tensor]
# forward(trees, chosen, ids [A, E], positions [A, E], write_positions=, tree_mask=, tree_start=) -> [A, E, V]
LevelFn = Callable[..., torch.Tensor]


def draft_settings(config: DraftSettings) -> dict:
    """``confidence``, ``tree_topk`` and ``tree_nodes`` from the drafters' settings (``DraftContext.config``)."""
    return {"confidence": config.draft_confidence, "tree_topk": config.tree_topk, "tree_nodes": config.tree_nodes}


def invariant_draws(module: torch.nn.Module, config: DraftSettings) -> None:
    """Under ``--batch-invariant`` (as resolved for the target) a drafter's own module computes each row alike
    whatever the batch too, so its draws do not depend on the batch either."""
    if config.batch_invariant:
        from specdecode.models import batch_invariant

        batch_invariant.enable(module, batch_invariant.DRAFT_WORKLOAD)


def check_tree(tree_topk: int, tree_nodes: int) -> None:
    if tree_topk < 1 or (tree_topk > 1 and tree_nodes < 1):
        raise ValueError(f"need tree_topk >= 1 and, for trees, tree_nodes >= 1; got {tree_topk}, {tree_nodes}")


class AutoregressiveDrafter(DrafterBase):
    """The settings of a drafter that runs its own model step by step, and its cache's size."""

    runner: Runner  # the draft model's runner (its KV cache)

    def __init__(self, confidence: float = 0.0, tree_topk: int = 1, tree_nodes: int = 0) -> None:
        if not 0.0 <= confidence < 1.0:
            raise ValueError(f"draft confidence threshold must be in [0, 1), got {confidence!r}")
        check_tree(tree_topk, tree_nodes)
        self.confidence = confidence
        self.tree_topk, self.tree_nodes = tree_topk, tree_nodes
        self.max_tree_nodes = tree_nodes if tree_topk > 1 else 0

    def reserve(self, num_slots: int, max_len: int) -> None:
        # greedy trees grow past the node budget before their rerank: room for that window too
        extra = GROWTH * self.tree_nodes + 1 if self.tree_topk > 1 else 0
        self.runner.ensure_capacity(num_slots, max_len + extra)


# -- chains ------------------------------------------------------------------------------------------
def propose_chain(
    bsz: int,
    rows: list[int],
    active: Sequence[SequenceView],
    num_tokens: list[int],
    logits: torch.Tensor,
    feed: FeedFn,
    confidence: float,
) -> Proposal:
    """Draft ``num_tokens[b]`` tokens for each batch row ``b`` in ``rows`` (``active`` its sequences),
    starting from ``logits`` [A, V] after each pending token; ``feed`` steps the drafter."""
    ks = [num_tokens[b] for b in rows]
    params = [s.params for s in active]
    warp_args = warp_tensors(params)
    processed = any(processors_of(s) for s in active)
    drafted: list[list[int]] = [[] for _ in active]  # each row's tokens so far (with processors only)
    all_greedy = all(p.greedy for p in params)  # then no laws are formed: greedy verification needs none
    uniforms = torch.zeros(len(active), max(ks))
    coupled = [i for i, s in enumerate(active) if s.params.coupled]  # these draw nothing: the noise decides
    for i, s in enumerate(active):
        if not s.params.greedy and not s.params.coupled:
            uniforms[i, : ks[i]] = torch.rand(ks[i], generator=s.generator)
    tokens = torch.zeros(bsz, max(ks), dtype=torch.long, device=logits.device)
    laws = []  # [A, V] per step: the warped draft law each token was drawn from
    j = 0
    while j < max(ks):
        law = None
        if processed:
            logits = process_rows(active, logits, drafted)
        if all_greedy:
            tok = greedy_tokens(logits).to(logits.device)
        else:
            law = warp(logits, *warp_args)
            tok = sample(law, uniforms[:, j])
            if coupled:  # the j-th draft token sits at position len(token_ids) + j
                noise = torch.stack(  # (the engine gives every coupled request a seed: Engine._resolve)
                    [
                        race_noise(cast(int, active[i].params.seed), len(active[i].token_ids) + j, law.shape[-1])
                        for i in coupled
                    ]
                )
                tok[coupled] = coupled_choice(law[coupled], noise)
            laws.append(law)
        tokens[rows, j] = tok
        if processed:
            for row, t in zip(drafted, tok.tolist()):
                row.append(t)
        if confidence > 0:
            ks = stop_unsure(ks, j, logits, law, tok, params, confidence)
        j += 1
        if j < max(ks):
            logits = feed(tok, j - 1)
    num = [0] * bsz
    for b, k in zip(rows, ks):
        num[b] = k
    width = max(num)
    probs = None
    if not all_greedy:
        probs = torch.zeros(bsz, width, laws[0].shape[-1], device=logits.device)
        probs[rows] = torch.stack(laws[:width], dim=1)
    return Proposal(tokens[:, :width], probs, torch.tensor(num, dtype=torch.long))


def stop_unsure(
    ks: list[int], j: int, logits: torch.Tensor, probs: torch.Tensor | None, tok: torch.Tensor, params, threshold: float
) -> list[int]:
    """End the chain of each row whose j-th token has draft probability below ``threshold``: the
    warped probability it was sampled with, or for greedy rows the draft's softmax."""
    greedy = torch.tensor([p.greedy for p in params], device=logits.device)
    conf = probs.gather(1, tok[:, None])[:, 0] if probs is not None else torch.zeros(len(params), device=logits.device)
    if greedy.any():
        soft = torch.softmax(logits[greedy], dim=-1).gather(1, tok[greedy, None])[:, 0]
        conf[greedy] = soft
    return [j + 1 if j < k and c < threshold else k for k, c in zip(ks, conf.tolist())]


# -- trees -------------------------------------------------------------------------------------------
def pad_nodes(nodes: list[int], width: int) -> list[int]:
    """``nodes`` padded to ``width`` by repeating the last (a padded entry writes the same K/V at the same place)."""
    return nodes + nodes[-1:] * (width - len(nodes))


def grow_tree(
    active: Sequence[SequenceView],
    depths: list[int],
    root_logits: torch.Tensor,
    starts: list[int],
    topk: int,
    max_nodes: int,
    forward: LevelFn,
) -> list[GrownTree]:
    """Grow each row's tree from ``root_logits`` [A, V] (after its pending token) to ``depths[r]``;
    tree node ``i`` of row ``r`` is written at ``starts[r] + i`` at position ``starts[r] - 1 + depth``.
    ``forward`` runs one level: the chosen nodes of every row, right-padded."""
    park = GROWTH * max_nodes  # a row with nothing to expand writes here: past any tree node, seeing the prefix

    def expand(trees: list[GrownTree], chosen: list[list[int]]) -> torch.Tensor:  # [A, E, V]
        e_max, width = max(len(c) for c in chosen), max(len(t.tokens) for t in trees)
        ids = torch.zeros(len(trees), e_max, dtype=torch.long)
        positions = torch.zeros(len(trees), e_max, dtype=torch.long)
        writes = torch.zeros(len(trees), e_max, dtype=torch.long)
        mask = torch.zeros(len(trees), e_max, width, dtype=torch.bool)
        for r, (tree, nodes) in enumerate(zip(trees, chosen)):
            if not nodes:
                positions[r], writes[r] = starts[r], starts[r] + park
            for e, i in enumerate(pad_nodes(nodes, e_max)):
                ids[r, e], writes[r, e] = tree.tokens[i], starts[r] + tree.writes[i]
                positions[r, e] = starts[r] - 1 + tree.depths[i]
                mask[r, e, tree.ancestors_or_self(i)] = True
        return forward(
            trees, chosen, ids, positions, write_positions=writes, tree_mask=mask, tree_start=torch.tensor(starts)
        )

    params = [s.params for s in active]
    coupled = [r for r, p in enumerate(params) if p.coupled]
    has_processors = any(processors_of(s) for s in active)
    root_logits = process_rows(active, root_logits, [()] * len(active))

    def processed(trees: list[GrownTree], chosen: list[list[int]]) -> torch.Tensor:  # [A, E, V]
        logits = expand(trees, chosen)
        if not has_processors:
            return logits
        # a node's children follow its root-to-node path
        prefixes = [
            [tuple(t.tokens[a] for a in t.ancestors_or_self(i)) for i in pad_nodes(nodes, logits.shape[1])]
            if nodes
            else [()] * logits.shape[1]
            for t, nodes in zip(trees, chosen)
        ]
        return process_batch(active, logits, prefixes)

    level = processed
    if coupled:  # grown as greedy rows over log(law / E): Gumbel top-k at each node's children's position
        root_logits = _perturb(root_logits.clone(), active, coupled, [[0] for _ in active])
        params = [replace(p, temperature=0.0) if p.coupled else p for p in params]

        def level(trees: list[GrownTree], chosen: list[list[int]]) -> torch.Tensor:  # [A, E, V]
            logits = processed(trees, chosen)
            depths = [
                [t.depths[i] for i in pad_nodes(nodes, logits.shape[1])] if nodes else [0] * logits.shape[1]
                for t, nodes in zip(trees, chosen)
            ]
            return _perturb(logits, active, [r for r in coupled if chosen[r]], depths)

    return grow_trees(root_logits, params, [s.generator for s in active], depths, topk, max_nodes, level)


def _perturb(
    logits: torch.Tensor, active: Sequence[SequenceView], rows: list[int], depths: list[list[int]]
) -> torch.Tensor:  # [A, V] or [A, E, V], perturbed in place
    """``log(law / E)`` for the listed rows: the warped draft law of entry ``e`` of row ``r`` over the race
    noise of the position after a node of depth ``depths[r][e]`` (``len(token_ids) + depth``)."""
    flat = logits if logits.dim() == 3 else logits[:, None]
    for r in rows:
        s = active[r]
        law = warp(flat[r], *(x.expand(flat.shape[1]) for x in warp_tensors([s.params])))  # [E, V]
        seed = cast(int, s.params.seed)  # the engine gives every coupled request one (Engine._resolve)
        noise = torch.stack([race_noise(seed, len(s.token_ids) + d, law.shape[-1]) for d in depths[r]]).to(law.device)
        flat[r] = (law / noise).log().to(flat.dtype)
    return logits


def tree_proposal(bsz: int, rows: list[int], trees: list[GrownTree], greedy: bool, device) -> Proposal:
    """Pack grown trees (of batch rows ``rows``) into a tree :class:`Proposal`."""
    width = max(1, max(len(t.tokens) for t in trees))
    tokens = torch.zeros(bsz, width, dtype=torch.long)
    parents = torch.full((bsz, width), -1, dtype=torch.long)
    num = torch.zeros(bsz, dtype=torch.long)
    # (a batch of coupled rows, grown as greedy rows, carries no laws: point masses)
    vocab = None if greedy else next((t.laws[0].shape[-1] for t in trees if t.laws and t.laws[0] is not None), None)
    probs = None if vocab is None else torch.zeros(bsz, width, vocab, device=device)
    for b, tree in zip(rows, trees):
        n = len(tree.tokens)
        num[b] = n
        if n:
            tokens[b, :n] = torch.tensor(tree.tokens)
            parents[b, :n] = torch.tensor(tree.parents)
            if probs is not None:
                probs[b, :n] = torch.stack(cast(list[torch.Tensor], tree.laws))  # a sampled tree's laws are set
    rule = DETERMINISTIC if greedy or probs is None else WITHOUT_REPLACEMENT
    return Proposal(tokens.to(device), probs, num.to(device), parents.to(device), rule)

"""EAGLE drafting (``--draft eagle:DIR``): a one-layer draft decoder runs autoregressively on the
target's features (:mod:`specdecode.models.eagle`), chains or EAGLE-2 dynamic trees.

The engine hands the drafter the target's features of every token it caches (``feature_layers``: the
final state, or EAGLE-3's low/middle/high layers). The drafter's own KV cache holds, at position
``t``, the pair (target feature of token ``t``, token ``t + 1``) for every cached target token: the
*true* entries. Before drafting it feeds the pairs the target has produced since the last step (the
pending token's and the accepted drafts'), whose last output predicts the token after the pending one;
each further draft step feeds (its own predicted feature, the token just drafted). Draft entries are
written past the true ones and overwritten by the true pairs of the next step, which is the whole
rollback: a static cache masks everything past a query's own position.

Chains sample each token from the warped draft law over the draft vocabulary (zero elsewhere) and hand
that law to verification (greedy: argmax, point masses). With ``--tree-topk K > 1`` the drafter grows
EAGLE-2's dynamic tree (:mod:`specdecode.drafters.dynamic_tree`: expand the best nodes by cumulative
draft probability, rerank to ``--tree-nodes`` for greedy rows, draws without replacement for sampled
rows). Either way verification is exact: the output follows the target's law.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch

from specdecode.drafters.autoregressive import (
    AutoregressiveDrafter,
    draft_settings,
    grow_tree,
    invariant_draws,
    pad_nodes,
    propose_chain,
    tree_proposal,
)
from specdecode.drafters.base import Proposal, SequenceView, TargetFeatures
from specdecode.models.base import FINAL, Runner
from specdecode.models.eagle import FINAL_KEY, WEIGHTS, EagleModel
from specdecode.models.hf import HFRunner
from specdecode.models.medusa import HeadsError, check_model, check_sizes, require_dir


def layer_ids(keys: list[str]) -> tuple[int, ...]:
    """Feature keys ("final", "layer14") -> runner feature layers."""
    return tuple(FINAL if k == FINAL_KEY else int(k.removeprefix("layer")) for k in keys)


class _Slot:
    """What the drafter knows of one sequence."""

    def __init__(self) -> None:
        self.tokens: list[int] = []  # tokens whose target features have arrived (positions 0..n-1)
        self.done = 0  # true pairs in the draft cache: positions 0..done-1
        self.pending: list[torch.Tensor] = []  # features g of positions done..len(tokens)-1, not fed yet
        self.broken = False  # features arrived out of order: draft nothing (exact either way)


class EagleDrafter(AutoregressiveDrafter):
    name = "eagle"

    def __init__(
        self,
        model: EagleModel,
        target: Runner,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        tree_topk: int = 1,
        tree_nodes: int = 0,
        confidence: float = 0.0,
    ) -> None:
        super().__init__(confidence, tree_topk, tree_nodes)
        self.model = model.to(device=device, dtype=dtype).eval().requires_grad_(False)
        self.target = target  # its input embeddings are the drafter's
        self.feature_layers = layer_ids(model.config.feature_layers)
        self.runner: HFRunner = HFRunner(self.model.decoder)  # it takes inputs_embeds
        self.vocab_size = target.vocab_size
        self.id_map = self.model.id_map.to(self.runner.device)
        self._raw_layer = () if model.config.final_mode else (1,)  # the fed-back feature of fusion drafters
        self.slots: dict[int, _Slot] = {}

    # -- state -------------------------------------------------------------------------------------
    def runners(self) -> dict[str, Runner]:
        return {"eagle": self.runner}

    def start(self, slots: list[int], prompts: list[list[int]]) -> None:
        for slot in slots:
            self.slots[slot] = _Slot()

    @torch.inference_mode()
    def observe(self, slots: list[int], features: list[TargetFeatures]) -> None:
        for slot, f in zip(slots, features):
            st = self.slots.setdefault(slot, _Slot())
            if not f.token_ids or st.broken:
                continue
            if f.start > len(st.tokens):
                st.broken = True
                continue
            if f.start < len(st.tokens):  # features again for known positions: keep what is still unfed before them
                if f.start <= st.done:  # the pair at f.start - 1 was fed with a token that may have changed
                    st.broken = True
                    continue
                st.pending = [torch.cat(st.pending)[: f.start - st.done]]
                st.tokens = st.tokens[: f.start]
            g = self.model.features(
                [f.hidden[layer].to(self.runner.device, self.runner.dtype) for layer in self.feature_layers]
            )
            st.pending.append(g)
            st.tokens.extend(f.token_ids)

    def move(self, src: int, dst: int) -> None:
        st = self.slots.pop(src, None)
        if st is None:
            return
        self.runner.copy_slot(src, dst, st.done)
        self.slots[dst] = st

    def release(self, slot: int) -> None:
        self.slots.pop(slot, None)

    # -- the draft decoder ---------------------------------------------------------------------------
    def _run(
        self, slots: torch.Tensor, g: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, **tree
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed pairs (g [A, q, H], tokens [A, q]) at ``positions``: (next feature [A, q, H], logits [A, q, V])."""
        x = self.model.step_input(g, self.target.embed(tokens).to(self.runner.device, self.runner.dtype))
        out = self.runner.forward(slots, tokens, positions, inputs_embeds=x, layers=self._raw_layer, **tree)
        nxt = self.model.feedback(out.hidden, out.features.get(1))
        return nxt, self._full_vocab(self.runner.logits(self.model.to_feature(out.hidden)))

    def _full_vocab(self, logits: torch.Tensor) -> torch.Tensor:  # [..., Vd] -> [..., V] (-inf off the draft vocab)
        full = torch.full((*logits.shape[:-1], self.vocab_size), -float("inf"), device=logits.device)
        full[..., self.id_map] = logits
        return full

    @torch.inference_mode()
    def _catch_up(self, active: Sequence[SequenceView]) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed each row's new true pairs (ragged, right-padded): (feature, logits) after the last one,
        which predict the token after the pending one."""
        rows = []
        for s in active:
            st = self.slots[s.slot]
            n = len(s.token_ids) - 1 - st.done  # positions done .. len-2
            rows.append((st, torch.cat(st.pending)[:n], s.token_ids[st.done + 1 : st.done + 1 + n]))
        width = max(len(t) for _, _, t in rows)
        dev, h = self.runner.device, self.model.config.hidden_size
        g = torch.zeros(len(active), width, h, device=dev, dtype=self.runner.dtype)
        ids = torch.zeros(len(active), width, dtype=torch.long)
        positions = torch.zeros(len(active), width, dtype=torch.long)
        for i, (st, feats, toks) in enumerate(rows):
            g[i, : len(toks)] = feats
            ids[i, : len(toks)] = torch.tensor(toks)
            positions[i] = (st.done + torch.arange(width)).clamp(max=self.runner.max_len - 1)
        slots = torch.tensor([s.slot for s in active])
        nxt, logits = self._run(slots, g, ids, positions)
        last = torch.tensor([len(t) - 1 for _, _, t in rows], device=dev)
        for s, (st, _, _) in zip(active, rows):
            st.done = len(s.token_ids) - 1
            st.pending = []
        idx = torch.arange(len(active), device=dev)
        return nxt[idx, last], logits[idx, last]

    def _ready(self, s: SequenceView) -> bool:
        st = self.slots.get(s.slot)
        return (
            st is not None
            and not st.broken
            and len(s.token_ids) >= 2
            and len(st.tokens) == len(s.token_ids) - 1
            and st.tokens[-1] == s.token_ids[-2]
            and st.done < len(s.token_ids) - 1
        )

    # -- drafting ----------------------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, seqs: Sequence[SequenceView], num_tokens: list[int]) -> Proposal:
        bsz = len(seqs)
        rows = [b for b in range(bsz) if num_tokens[b] > 0 and self._ready(seqs[b])]
        if not rows:
            return Proposal.empty(bsz)
        active = [seqs[b] for b in rows]
        g, logits = self._catch_up(active)
        if self.tree_topk > 1:
            return self._tree(bsz, rows, active, g, logits, num_tokens)
        return self._chain(bsz, rows, active, g, logits, num_tokens)

    def _chain(
        self, bsz: int, rows: list[int], active, g: torch.Tensor, logits: torch.Tensor, num_tokens: list[int]
    ) -> Proposal:
        slots = torch.tensor([s.slot for s in active])
        starts = torch.tensor([len(s.token_ids) - 1 for s in active])  # the pending token's position

        def feed(tok: torch.Tensor, j: int) -> torch.Tensor:  # the j-th draft token [A] -> logits after it [A, V]
            nonlocal g  # [A, H] the feature fed with it: the one the previous step predicted
            g, step_logits = self._run(slots, g[:, None], tok[:, None], (starts + j)[:, None])
            g = g[:, 0]
            return step_logits[:, 0]

        return propose_chain(bsz, rows, active, num_tokens, logits, feed, self.confidence)

    def _tree(
        self, bsz: int, rows: list[int], active, root_g: torch.Tensor, root_logits: torch.Tensor, num_tokens: list[int]
    ) -> Proposal:
        starts = [len(s.token_ids) - 1 for s in active]  # the window: node i is written at start + i
        slots = torch.tensor([s.slot for s in active])
        out_g: list[dict[int, torch.Tensor]] = [{-1: root_g[r]} for r in range(len(active))]  # node -> output feature

        def forward(trees, chosen, ids: torch.Tensor, positions: torch.Tensor, **tree) -> torch.Tensor:  # [A, E, V]
            g = torch.zeros(
                *ids.shape, self.model.config.hidden_size, device=self.runner.device, dtype=self.runner.dtype
            )  # each node is fed with its parent's output feature
            for r, (t, nodes) in enumerate(zip(trees, chosen)):
                if not nodes:
                    g[r] = root_g[r]
                for e, i in enumerate(pad_nodes(nodes, ids.shape[1])):
                    g[r, e] = out_g[r][t.parents[i]]
            nxt, logits = self._run(slots, g, ids, positions, **tree)
            for r, nodes in enumerate(chosen):
                for e, i in enumerate(nodes):
                    out_g[r][i] = nxt[r, e]
            return logits

        trees = grow_tree(
            active, [num_tokens[b] for b in rows], root_logits, starts, self.tree_topk, self.tree_nodes, forward
        )
        return tree_proposal(bsz, rows, trees, all(s.params.greedy for s in active), self.runner.device)


def check_target(model: EagleModel, target: Runner, where: str) -> None:
    """Refuse a drafter trained for another target (sizes, feature layers, output-layer fingerprint)."""
    cfg = model.config
    check_sizes("EAGLE drafter", "features", cfg, target, where)
    layers = [x for x in layer_ids(cfg.feature_layers) if x != FINAL]
    trained_depth = cfg.target.get("num_layers")
    if (trained_depth and trained_depth != target.num_layers) or any(x > target.num_layers for x in layers):
        raise HeadsError(
            f"EAGLE drafter {where} reads feature layers {cfg.feature_layers} of a {trained_depth}-layer "
            f"model; this target has {target.num_layers} layers: it was trained for another model "
            f"({cfg.target.get('spec', '?')})"
        )
    check_model("EAGLE drafter", cfg, model.id_map, target, where)


def validate(arg: str) -> None:
    """Cheap checks before any model loads: the spec names an EAGLE drafter directory."""
    if not arg:
        raise HeadsError(
            "draft spec 'eagle' needs the drafter's directory: eagle:DIR (train one with "
            "`specdecode heads train --kind eagle`)"
        )
    require_dir(Path(arg).expanduser(), WEIGHTS, "eagle", "an EAGLE drafter", f"eagle:{arg}: ")


def draft_dtype(device, target_dtype: torch.dtype) -> torch.dtype:
    """The draft layer computes in the target's dtype where that dtype is native (CUDA, or bf16 on a CPU
    with AVX512-BF16/AMX: half the cost of float32 there), else in float32 (bf16 emulated on an
    AVX2-only CPU is slower than float32)."""
    from specdecode.models.device import native_bf16

    if str(device) != "cpu" or (target_dtype == torch.bfloat16 and native_bf16("cpu")):
        return target_dtype
    return torch.float32


def build(arg: str, ctx) -> EagleDrafter:
    """``--draft eagle:DIR`` (a directory written by ``specdecode heads train --kind eagle``)."""
    validate(arg)
    model = EagleModel.load(Path(arg))
    check_target(model, ctx.target, arg)
    invariant_draws(model, ctx.config)
    dtype = draft_dtype(ctx.target.device, ctx.target.dtype)
    return EagleDrafter(model, ctx.target, ctx.target.device, dtype, **draft_settings(ctx.config))

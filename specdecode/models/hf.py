"""The Hugging Face runner: a causal LM over slot-addressed sequences, behind :class:`~specdecode.models.base.Runner`.

The runner owns a :class:`StaticKVCache` and builds the attention mask itself, so each batch row can
sit at its own length, rolling back is free, and a forward may carry a tree of candidates (RoPE
position ``start + depth``, K/V written at ``start + index``, visibility from a tree mask). Works for
decoder-only models whose attention layers call ``past_key_values.update(k, v, layer_idx)`` and
whose logits are ``lm_head(final hidden state)`` (Llama, Qwen2/2.5/3, Mistral and their relatives).
"""

from __future__ import annotations

import itertools
from typing import Any, Sequence, cast

import torch

from specdecode.models import batch_invariant as batch_invariant_mode
from specdecode.models.base import FINAL, Features, ForwardOutput, Runner
from specdecode.models.kv_cache import StaticKVCache

PREFILL_TOKENS = 2048  # tokens per prefill forward (all rows together): bounds attention memory
PAD_SLACK = 0.25  # a prefill batch may compute at most this share more tokens than its rows hold


def pack_rows(lengths: Sequence[int], slack: float = PAD_SLACK) -> list[list[int]]:
    """Group rows of a ragged prefill so that padding each group to its longest row computes at most
    ``1 + slack`` times the group's real tokens: rows of similar length share a forward, a short row
    beside a long one gets its own. Longest first; each group's indices in ascending order."""
    groups: list[list[int]] = []
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    for i in order:
        g = groups[-1] if groups else None
        if g is not None and (len(g) + 1) * lengths[g[0]] <= (1 + slack) * (sum(lengths[j] for j in g) + lengths[i]):
            g.append(i)
        else:
            groups.append([i])
    return [sorted(g) for g in groups]


class HFRunner(Runner):
    backend = "torch"

    def __init__(
        self, model: torch.nn.Module, num_slots: int = 0, max_len: int = 0, batch_invariant: bool = False
    ) -> None:
        # a transformers causal LM: its config, base model and head are reached by name, which torch's Module
        # typing cannot follow (a submodule attribute reads as ``Tensor | Module``)
        hf = cast(Any, model)
        cfg = hf.config
        if getattr(cfg, "final_logit_softcapping", None):
            raise ValueError(f"{cfg.model_type}: final logit soft-capping is not supported")
        if batch_invariant and not batch_invariant_mode.is_enabled(model):  # rows alike whatever the batch
            batch_invariant_mode.enable(model)
        self.batch_invariant = batch_invariant_mode.is_enabled(model)
        if self.batch_invariant:  # every kernel shape probed now, under one progress bar, not mid-request
            batch_invariant_mode.prepare(model)
        self.model = hf
        self.base = hf.base_model
        self.lm_head = hf.get_output_embeddings()
        self.vocab_size = int(getattr(self.lm_head, "out_features", None) or self.lm_head.weight.shape[0])
        self.hidden_size = int(cfg.hidden_size)
        self.num_layers = int(cfg.num_hidden_layers)
        self.dtype = next(model.parameters()).dtype
        self.device = next(model.parameters()).device
        self.identity = _identity(model)
        self.eos_token_ids = _eos_ids(getattr(model, "generation_config", None))
        self.sdpa = getattr(cfg, "_attn_implementation", "sdpa") in ("sdpa", batch_invariant_mode.NAME)  # bool masks
        self.sliding_window = getattr(cfg, "sliding_window", None) if getattr(cfg, "use_sliding_window", True) else None
        self.layer_types = list(getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers)
        self._head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self._kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.num_slots = self.max_len = 0
        self.cache: StaticKVCache | None = None
        if num_slots and max_len:
            self.ensure_capacity(num_slots, max_len)

    # -- sizes ------------------------------------------------------------------------------------
    def ensure_capacity(self, num_slots: int, max_len: int) -> None:
        if self.cache is not None and self.num_slots >= num_slots and self.max_len >= max_len:
            return
        self.num_slots, self.max_len = max(num_slots, self.num_slots), max(max_len, self.max_len)
        self.cache = None  # free the old buffers before allocating the new ones
        self.cache = StaticKVCache(
            self.num_layers, self.num_slots, self._kv_heads, self._head_dim, self.max_len, self.dtype, self.device
        )

    def kv_bytes(self) -> int:
        return self.cache.nbytes() if self.cache is not None else 0

    @property
    def _kv(self) -> StaticKVCache:
        """The cache (made by :meth:`ensure_capacity`, which the engine calls before any forward)."""
        assert self.cache is not None, "ensure_capacity first"
        return self.cache

    # -- forward ----------------------------------------------------------------------------------
    def _mask(
        self,
        positions: torch.Tensor,
        writes: torch.Tensor,
        tree_mask: torch.Tensor | None,
        tree_start: torch.Tensor | None,
        kv_len: int,
        window: int | None,
    ) -> torch.Tensor:
        keys = torch.arange(kv_len, device=self.device)[None, None, :]  # [1, 1, kv_len]
        if tree_mask is None:  # chain: everything written at or before the query's own index
            visible = keys <= writes[:, :, None]  # [B, q, kv_len]
        else:  # tree: the cache before the row's window, then the window's columns the tree mask allows
            assert tree_start is not None  # forward fills it in for a tree
            q, width = tree_mask.shape[1], tree_mask.shape[2]
            visible = (keys < tree_start[:, None, None]).expand(-1, q, -1).clone()
            columns = tree_start[:, None, None] + torch.arange(width, device=self.device)[None, None, :]
            visible.scatter_(2, columns.expand(-1, q, -1), tree_mask)
        if window:
            near = keys > positions[:, :, None] - window
            if tree_mask is not None and tree_start is not None:  # tree keys are not at their position: the
                near |= keys >= tree_start[:, None, None]  # window applies to the prefix
            visible &= near
        visible = visible[:, None]  # [B, 1, q, kv_len]
        if self.sdpa:
            return visible
        return torch.zeros(visible.shape, dtype=self.dtype, device=self.device).masked_fill_(
            ~visible, torch.finfo(self.dtype).min
        )

    @torch.inference_mode()
    def forward(
        self,
        slots: torch.Tensor,  # [B] long
        input_ids: torch.Tensor,  # [B, q] long
        positions: torch.Tensor,  # [B, q] long RoPE positions
        *,
        write_positions: torch.Tensor | None = None,  # [B, q] K/V write index (default: positions)
        tree_mask: torch.Tensor | None = None,  # [B, q, W] bool: query i sees the key at tree_start + j
        tree_start: torch.Tensor | None = None,  # [B] first write index of the tree window (default: min write)
        layers: Sequence[int] = (),
        inputs_embeds: torch.Tensor | None = None,  # [B, q, H]: fed instead of input_ids' embeddings
    ) -> ForwardOutput:
        assert self.cache is not None, "no KV cache: call ensure_capacity() first"
        dev = self.device
        slots, input_ids, positions = slots.to(dev), input_ids.to(dev), positions.to(dev)
        if inputs_embeds is not None:
            inputs_embeds = inputs_embeds.to(device=dev, dtype=self.dtype)
        writes = positions if write_positions is None else write_positions.to(dev)
        if tree_mask is not None:
            tree_mask = tree_mask.to(dev)
        elif write_positions is not None and not torch.equal(writes, positions):
            q = writes.shape[1]  # separate write indices without a tree: a chain over the queries
            tree_mask = torch.ones(q, q, dtype=torch.bool, device=dev).tril_()[None].expand(writes.shape[0], -1, -1)
        kv_len = int(writes.max()) + 1
        if tree_mask is not None:
            tree_start = writes.min(dim=1).values if tree_start is None else tree_start.to(dev)
            kv_len = max(kv_len, int(tree_start.max()) + tree_mask.shape[2])
        by_type = {
            t: self._mask(
                positions,
                writes,
                tree_mask,
                tree_start,
                kv_len,
                self.sliding_window if t == "sliding_attention" else None,
            )
            for t in set(self.layer_types)
        }
        # a 4D tensor is used as-is by every HF model; the per-type dict only by hybrid-attention ones
        masks = next(iter(by_type.values())) if len(by_type) == 1 else by_type
        captured: Features = {}
        hooks = self._capture(layers, captured)
        self._kv.bind(slots, writes, kv_len)
        try:
            out = self.base(
                input_ids=None if inputs_embeds is not None else input_ids,
                inputs_embeds=inputs_embeds,
                position_ids=positions,
                attention_mask=masks,
                past_key_values=self.cache,
                use_cache=True,
            )
        finally:
            self._kv.unbind()
            for h in hooks:
                h.remove()
        hidden = out.last_hidden_state
        if FINAL in layers:
            captured[FINAL] = hidden
        return ForwardOutput(hidden, captured)

    def _capture(self, layers: Sequence[int], into: Features) -> list:
        hooks = []
        for layer in layers:
            if layer == FINAL:
                continue
            if not 0 <= layer <= self.num_layers:
                raise ValueError(f"feature layer {layer} outside 0..{self.num_layers} (or {FINAL} for the final state)")
            module = self.base.get_input_embeddings() if layer == 0 else self.base.layers[layer - 1]

            def hook(_module, _args, output, layer=layer):
                into[layer] = output[0] if isinstance(output, tuple) else output

            hooks.append(module.register_forward_hook(hook))
        return hooks

    @torch.inference_mode()
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # [...] long -> [..., H] input embeddings
        return self.base.get_input_embeddings()(input_ids.to(self.device))

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [..., hidden] -> [..., V] float32
        return self.lm_head(hidden).float()

    @torch.inference_mode()
    def prefill(
        self,
        slots: Sequence[int],
        prompts: Sequence[list[int]],
        layers: Sequence[int] = (),
        starts: Sequence[int] | None = None,
    ) -> list[Features]:
        """Write K/V for each ``prompts[i]`` at positions ``starts[i]..`` (default 0) of ``slots[i]``;
        return the requested layers' hidden states of every prompt token.

        Rows of similar length share a forward (:func:`pack_rows`: padding costs at most a quarter
        more tokens), right-padded (padding writes past a row's length, at most at the cache's last
        position, where it is masked and later overwritten) and processed in chunks that bound
        attention memory.
        """
        starts = [0] * len(prompts) if starts is None else list(starts)
        empty = {layer: torch.zeros(0, self.hidden_size, dtype=self.dtype, device=self.device) for layer in layers}
        feats: list[Features] = [dict(empty) for _ in prompts]
        rows = [i for i, p in enumerate(prompts) if p]
        end = max((starts[i] + len(prompts[i]) for i in rows), default=0)
        if end > self.max_len:
            raise ValueError(f"prefill past the cache: position {end - 1} of a cache of {self.max_len}")
        # ragged rows (chunks of several prompts, drafters catching up) would be padded to the longest:
        # rows of unlike length go in separate forwards
        for group in pack_rows([len(prompts[i]) for i in rows], PAD_SLACK):
            self._prefill_rows([rows[g] for g in group], slots, prompts, starts, layers, feats)
        return feats

    def _prefill_rows(
        self,
        rows: list[int],
        slots: Sequence[int],
        prompts: Sequence[list[int]],
        starts: list[int],
        layers: Sequence[int],
        feats: list[Features],
    ) -> None:
        width = max(len(prompts[i]) for i in rows)
        chunk = max(16, PREFILL_TOKENS // len(rows))
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        for r, i in enumerate(rows):
            ids[r, : len(prompts[i])] = torch.tensor(prompts[i])
        slot_t = torch.tensor([slots[i] for i in rows])
        first = torch.tensor([starts[i] for i in rows])[:, None]
        parts: list[Features] = []
        with batch_invariant_mode.bulk():  # prompt tokens: the bulk plans, whatever the batch
            for lo in range(0, width, chunk):
                hi = min(width, lo + chunk)
                positions = (first + torch.arange(lo, hi)[None]).clamp_(max=self.max_len - 1)
                parts.append(self.forward(slot_t, ids[:, lo:hi], positions, layers=layers).features)
        for layer in layers:
            full = torch.cat([p[layer] for p in parts], dim=1)  # [rows, width, H]
            for r, i in enumerate(rows):
                feats[i][layer] = full[r, : len(prompts[i])]

    # -- KV operations ----------------------------------------------------------------------------
    def truncate(self, slot: int, length: int) -> None:
        """Free in a static cache: positions past ``length`` are masked by position, then overwritten."""

    def compact(self, slot: int, src: Sequence[int], dst_start: int) -> None:
        self._kv.move(slot, list(src), dst_start)

    def copy_slot(self, src: int, dst: int, length: int) -> None:
        self._kv.copy_slot(src, dst, length)

    def export_kv(self, slot: int, length: int):
        return self._kv.export(slot, length)

    def import_kv(self, slot: int, state) -> None:
        self._kv.load(slot, state)


_IDENTITIES = itertools.count()


def _identity(model: Any) -> str:
    """A name for the weights, the same for every runner over this model object (never reused, unlike id())."""
    if not hasattr(model, "_specdecode_identity"):
        model._specdecode_identity = f"hf:{next(_IDENTITIES)}"
    return model._specdecode_identity


def _eos_ids(gen_cfg) -> set[int]:
    source = getattr(gen_cfg, "eos_token_id", None)
    if isinstance(source, int):
        return {source}
    return {int(x) for x in source} if source else set()

"""Runs a Hugging Face causal LM over slot-addressed sequences with explicit positions.

The runner owns a :class:`StaticKVCache` and builds the attention mask itself (key ``j`` is visible
to a query at position ``p`` iff ``j <= p``), so each batch row can sit at its own length and
rolling back is free. Works for decoder-only models whose attention layers call
``past_key_values.update(k, v, layer_idx)`` and whose logits are ``lm_head(final hidden state)``
(Llama, Qwen2/2.5/3, Mistral and their relatives).
"""

from __future__ import annotations

import torch

from specdecode.models.kv_cache import StaticKVCache

PREFILL_TOKENS = 2048  # tokens per prefill forward (all rows together): bounds attention memory


class ModelRunner:
    def __init__(self, model: torch.nn.Module, num_slots: int, max_len: int) -> None:
        cfg = model.config
        if getattr(cfg, "final_logit_softcapping", None):
            raise ValueError(f"{cfg.model_type}: final logit soft-capping is not supported")
        self.model = model
        self.base = model.base_model
        self.lm_head = model.get_output_embeddings()
        self.vocab_size = int(self.lm_head.weight.shape[0])
        self.dtype = next(model.parameters()).dtype
        self.device = next(model.parameters()).device
        self.sdpa = getattr(cfg, "_attn_implementation", "sdpa") == "sdpa"
        self.sliding_window = getattr(cfg, "sliding_window", None) if getattr(cfg, "use_sliding_window", True) else None
        self.layer_types = list(getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.max_len = max_len
        self.cache = StaticKVCache(cfg.num_hidden_layers, num_slots, kv_heads, head_dim, max_len, self.dtype, self.device)

    def _mask(self, positions: torch.Tensor, kv_len: int, window: int | None) -> torch.Tensor:
        keys = torch.arange(kv_len, device=positions.device)[None, None, :]  # [1, 1, kv_len]
        visible = keys <= positions[:, :, None]  # [B, q, kv_len]
        if window:
            visible &= keys > positions[:, :, None] - window
        visible = visible[:, None]  # [B, 1, q, kv_len]
        if self.sdpa:
            return visible
        return torch.zeros(visible.shape, dtype=self.dtype).masked_fill_(~visible, torch.finfo(self.dtype).min)

    @torch.inference_mode()
    def forward(
        self,
        slots: torch.Tensor,  # [B] long
        input_ids: torch.Tensor,  # [B, q] long
        positions: torch.Tensor,  # [B, q] long; K/V of token (b, t) is written at positions[b, t]
    ) -> torch.Tensor:  # [B, q, hidden] final hidden states
        kv_len = int(positions.max()) + 1
        masks = {t: self._mask(positions, kv_len, self.sliding_window if t == "sliding_attention" else None)
                 for t in set(self.layer_types)}
        # a 4D tensor is used as-is by every HF model; the per-type dict only by hybrid-attention ones
        masks = next(iter(masks.values())) if len(masks) == 1 else masks
        self.cache.bind(slots, positions)
        try:
            out = self.base(
                input_ids=input_ids.to(self.device),
                position_ids=positions.to(self.device),
                attention_mask=masks,
                past_key_values=self.cache,
                use_cache=True,
            )
        finally:
            self.cache.unbind()
        return out.last_hidden_state

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [..., hidden] -> [..., V] float32
        return self.lm_head(hidden).float()

    @torch.inference_mode()
    def prefill(self, slots: list[int], prompts: list[list[int]]) -> None:
        """Write K/V for each ``prompts[i]`` at positions ``0..len-1`` of ``slots[i]`` (no logits).

        Rows are right-padded (padding writes past a row's length, where it is masked and later
        overwritten) and processed in chunks that bound attention memory.
        """
        rows = [(s, p) for s, p in zip(slots, prompts) if p]
        if not rows:
            return
        width = max(len(p) for _, p in rows)
        chunk = max(16, PREFILL_TOKENS // len(rows))
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        for i, (_, p) in enumerate(rows):
            ids[i, : len(p)] = torch.tensor(p)
        slot_t = torch.tensor([s for s, _ in rows])
        for lo in range(0, width, chunk):
            hi = min(width, lo + chunk)
            positions = torch.arange(lo, hi)[None].expand(len(rows), -1)
            self.forward(slot_t, ids[:, lo:hi], positions)

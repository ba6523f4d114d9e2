"""A static, slot-addressed KV cache with O(1) rollback.

Each sequence owns a *slot*: a row of per-layer buffers ``[slots, kv_heads, max_len, head_dim]``.
A forward pass writes its keys/values at explicit positions, so rolling back after a rejection is
just forgetting a length: stale slots past the valid length are masked out by position and
overwritten by the next forward (the gpt-fast design). Nothing here knows about speculation.

The object is handed to a Hugging Face model as ``past_key_values``; HF attention layers call
``update(key_states, value_states, layer_idx)`` and attend over what it returns.
"""

from __future__ import annotations

import torch


class StaticKVCache:
    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (num_slots, num_kv_heads, max_len, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.num_slots = num_slots
        self.max_len = max_len
        self._slots: torch.Tensor | None = None  # [B] slot of each batch row, for the running forward
        self._contiguous: slice | None = None  # the same slots as a slice when they are consecutive
        self._positions: torch.Tensor | None = None  # [B, q] where each query token's K/V goes
        self._kv_len = 0  # keys returned to attention: [0, kv_len)

    # -- set by the runner around each forward ------------------------------------------------
    def bind(self, slots: torch.Tensor, positions: torch.Tensor, kv_len: int | None = None) -> None:
        """``positions`` [B, q]: the write index of each query token's K/V; attention reads keys
        ``[0, kv_len)`` (default: up to the last write)."""
        kv_len = int(positions.max()) + 1 if kv_len is None else kv_len
        if kv_len > self.max_len:
            raise ValueError(f"position {kv_len - 1} past the cache length {self.max_len}")
        self._slots = slots
        first = int(slots[0])
        consecutive = bool((slots == torch.arange(first, first + len(slots), device=slots.device)).all())
        self._contiguous = slice(first, first + len(slots)) if consecutive else None
        self._positions = positions
        self._kv_len = kv_len

    def unbind(self) -> None:
        self._slots = self._positions = self._contiguous = None

    # -- the Hugging Face cache interface ------------------------------------------------------
    def update(
        self,
        key_states: torch.Tensor,  # [B, kv_heads, q, head_dim]
        value_states: torch.Tensor,  # [B, kv_heads, q, head_dim]
        layer_idx: int,
        cache_kwargs: dict | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # each [B, kv_heads, kv_len, head_dim]
        assert self._slots is not None and self._positions is not None, "cache used outside bind()"
        slots = self._slots[:, None].expand_as(self._positions)  # [B, q]
        k_buf, v_buf = self.keys[layer_idx], self.values[layer_idx]
        k_buf[slots, :, self._positions] = key_states.transpose(1, 2).to(k_buf.dtype)
        v_buf[slots, :, self._positions] = value_states.transpose(1, 2).to(v_buf.dtype)
        if self._contiguous is not None:
            return k_buf[self._contiguous, :, : self._kv_len], v_buf[self._contiguous, :, : self._kv_len]
        return k_buf[self._slots, :, : self._kv_len], v_buf[self._slots, :, : self._kv_len]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._kv_len

    # -- slot management -------------------------------------------------------------------------
    def copy_slot(self, src: int, dst: int, length: int) -> None:
        """Copy the first ``length`` positions of slot ``src`` into slot ``dst``."""
        for buf in (*self.keys, *self.values):
            buf[dst, :, :length] = buf[src, :, :length]

    def move(self, slot: int, src: list[int], dst_start: int) -> None:
        """Move the entries at indices ``src`` of ``slot`` to ``dst_start, dst_start + 1, ...``
        (gathered before written, so source and destination may overlap)."""
        if not src:
            return
        idx = torch.tensor(src, device=self.keys[0].device)
        for buf in (*self.keys, *self.values):
            buf[slot, :, dst_start : dst_start + len(src)] = buf[slot, :, idx]

    def export(self, slot: int, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, copies of the first ``length`` keys and values of ``slot``."""
        return [(k[slot, :, :length].clone(), v[slot, :, :length].clone()) for k, v in zip(self.keys, self.values)]

    def load(self, slot: int, state: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for (k, v), (sk, sv) in zip(zip(self.keys, self.values), state):
            k[slot, :, : sk.shape[1]].copy_(sk)
            v[slot, :, : sv.shape[1]].copy_(sv)

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in (*self.keys, *self.values))

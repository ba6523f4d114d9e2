"""The runner interface: the only way the engine, drafters, ``check``, ``bench`` and the server touch a model.

A runner holds one model and a KV cache of ``num_slots`` sequences ("slots") of up to ``max_len``
positions each. Everything above it speaks slots, token ids and positions:

* ``prefill(slots, prompts, layers, starts=)`` writes the K/V of each prompt at positions
  ``start..start+len-1`` of its slot (``start`` 0 by default; a prompt prefilled in chunks continues
  where its slot's cache ends) and returns the hidden states of the requested feature layers for
  every prompt token;
* ``forward(slots, ids, positions, write_positions=, tree_mask=, tree_start=, layers=)`` runs ``ids``
  with RoPE positions ``positions``; the K/V of query ``i`` are written at ``write_positions[:, i]``
  (default: ``positions``). Without a tree mask a query sees every cached key up to its own write
  index (the chain case). With a tree mask, a row's *window* starts at ``tree_start[b]`` (default: its
  smallest write index): a query sees every key before the window, and the key at ``tree_start + j``
  iff ``tree_mask[b, i, j]``. A tree of candidates puts node ``i`` at position ``start + depth`` and
  writes it at ``start + i``; a drafter growing a tree level by level feeds only the new level, whose
  mask names its ancestors among the nodes already written;
* ``logits(hidden)`` turns final hidden states into float32 logits; ``embed(ids)`` gives input embeddings;
* KV operations: ``truncate`` (forget past a length), ``compact`` (move chosen positions of a slot
  to a contiguous run: keeps an accepted tree branch), ``copy_slot``, and ``export_kv/import_kv``
  (an opaque snapshot of a slot's prefix, for prefix reuse).

Feature layers (``layers``) name hidden states like Hugging Face's ``output_hidden_states``:
``0`` the embedding output, ``i`` (1..num_layers) the output of decoder layer ``i``, and
:data:`FINAL` the final normed hidden state, the one logits come from. A runner computes only what
is asked for; ``()`` costs nothing.

Rollback in a static cache is free: entries past a sequence's valid length are masked by position
and overwritten later, so ``truncate`` may be a no-op there. Backends that need it (llama.cpp's
``llama_memory_seq_rm``) do the work in ``truncate``; callers always call it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

FINAL = -1  # feature layer: the final normed hidden state (what the LM head reads)

Features = dict[int, torch.Tensor]  # feature layer -> hidden states


@dataclass
class ForwardOutput:
    hidden: torch.Tensor  # [B, q, H] final normed hidden states
    features: Features = field(default_factory=dict)  # layer -> [B, q, H], only the layers asked for


class Runner:
    """What every runner has; backends subclass it (``specdecode.models.backends``). The attributes
    after ``identity`` are optional capabilities: a runner that has them sets them, the defaults here
    say what a runner without them means, and nothing above a runner probes for others."""

    num_slots: int
    max_len: int  # positions per slot
    vocab_size: int  # rows of the LM head (logits width)
    hidden_size: int
    num_layers: int
    dtype: torch.dtype
    device: torch.device
    eos_token_ids: set[int]  # from the model's generation config (may be empty)
    identity: str  # names the weights: equal identities compute equal K/V for equal tokens
    # -- optional capabilities, with their defaults -------------------------------------------------
    backend: str = "torch"  # the registry name of the backend that made it (specdecode.models.backends)
    threads: int | None = None  # CPU threads the backend computes with (None: torch's own setting)
    batch_invariant: bool = False  # every row computed alike whatever the batch and verify width
    # greedy divergences within near_tie_rel * |top logit| count as numeric near-ties (`check`); logit_eps is
    # the logit resolution `bench` reports ties at. None: decided by the dtype
    near_tie_rel: float | None = None
    logit_eps: float | None = None
    # import_kv(export_kv(...)) restores a slot so that it computes bit for bit what a prefill would
    # (check's prefix reuse relies on it; a runner that cannot promise it is prefilled for real)
    kv_snapshots_exact: bool = True

    @property
    def where(self) -> str:
        """Where it runs, for the stats line: backend, device and dtype."""
        return f"{self.backend} {self.device.type} {str(self.dtype).removeprefix('torch.')}"

    def ensure_capacity(self, num_slots: int, max_len: int) -> None:
        """Make room for at least ``num_slots`` slots of ``max_len`` positions (may drop cached K/V)."""
        raise NotImplementedError

    def prefill(
        self,
        slots: Sequence[int],
        prompts: Sequence[list[int]],
        layers: Sequence[int] = (),
        starts: Sequence[int] | None = None,
    ) -> list[Features]:
        """Write each prompt's K/V at positions ``starts[i]..starts[i]+len-1`` of its slot (default 0;
        the slot's positions before ``starts[i]`` stay as they are and are attended to: a prompt in
        chunks); per prompt, the requested layers' hidden states ``[len, H]`` (empty dicts when
        ``layers`` is empty)."""
        raise NotImplementedError

    def forward(
        self,
        slots: torch.Tensor,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        *,
        write_positions: torch.Tensor | None = None,
        tree_mask: torch.Tensor | None = None,
        tree_start: torch.Tensor | None = None,
        layers: Sequence[int] = (),
    ) -> ForwardOutput:
        """``slots`` [B], ``input_ids``/``positions``/``write_positions`` [B, q], ``tree_mask`` [B, q, W],
        ``tree_start`` [B]."""
        raise NotImplementedError

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[..., H]`` -> ``[..., vocab_size]`` float32."""
        raise NotImplementedError

    def score_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final normed hidden states (made elsewhere: a probe) ``[..., H]`` -> float32 logits. The
        default is :meth:`logits`; a runner whose ``logits`` only passes its forward's output on
        (llama.cpp's) scores them another way."""
        return self.logits(hidden)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token ids ``[...]`` -> the model's input embeddings ``[..., H]`` (EAGLE reads the target's)."""
        raise NotImplementedError

    def truncate(self, slot: int, length: int) -> None:
        """Only positions ``< length`` of ``slot`` are valid from now on."""
        raise NotImplementedError

    def compact(self, slot: int, src: Sequence[int], dst_start: int) -> None:
        """Move the K/V at write indices ``src`` of ``slot`` to ``dst_start, dst_start + 1, ...``."""
        raise NotImplementedError

    def copy_slot(self, src: int, dst: int, length: int) -> None:
        """Copy positions ``0..length-1`` of slot ``src`` into slot ``dst``."""
        raise NotImplementedError

    def export_kv(self, slot: int, length: int) -> Any:
        """An opaque snapshot of positions ``0..length-1`` of ``slot``."""
        raise NotImplementedError

    def import_kv(self, slot: int, state: Any) -> None:
        """Restore a snapshot from :meth:`export_kv` (of a runner with the same identity) into ``slot``."""
        raise NotImplementedError

    def kv_bytes(self) -> int:
        """Memory held by the KV cache."""
        raise NotImplementedError


@torch.inference_mode()
def next_token_logits(runner: Runner, token_ids: list[int], slot: int = 0) -> torch.Tensor:  # [V] float32
    """The model's logits for the token after ``token_ids`` (teacher-forced, batch of one, in ``slot``)."""
    runner.prefill([slot], [token_ids[:-1]])
    pos = torch.tensor([[len(token_ids) - 1]])
    return runner.logits(runner.forward(torch.tensor([slot]), torch.tensor([[token_ids[-1]]]), pos).hidden)[0, 0].cpu()

"""Peer baselines: Hugging Face ``generate`` target-only and assisted generation (``assistant_model=``).

Both run with an explicit, fresh :class:`~transformers.GenerationConfig`, so nothing from the
checkpoint's ``generation_config.json`` (a default top-k, a repetition penalty, ...) makes them
sample differently from the engine. HF's assisted generation keeps its own defaults (20 draft tokens,
constant schedule, stop drafting when the draft's confidence drops below 0.4) because that is what a
user of ``assistant_model=`` gets; its adaptive state, which HF keeps on the assistant model across
calls, is reset before every call so that each prompt starts from the same state.

EOS parity with the engine: with ``ignore_eos`` every configuration generates exactly
``max_new_tokens``; EOS is then an ordinary token (HF gets ``eos_token_id=None``, the engine
``ignore_eos=True``) rather than a suppressed one, so greedy outputs stay comparable.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass

import torch


@dataclass
class HFRun:
    token_ids: list[int]
    wall_s: float


def generation_config(
    temperature: float, top_p: float, max_new_tokens: int, eos_token_ids: list[int] | None, pad_token_id: int | None
):
    from transformers import GenerationConfig

    sampled = temperature > 0
    return GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=sampled,
        temperature=temperature if sampled else None,
        top_p=top_p if sampled else None,
        top_k=0 if sampled else None,
        eos_token_id=eos_token_ids or None,
        pad_token_id=pad_token_id,
    )


class HFBaseline:
    """``model.generate`` on one prompt at a time, optionally with an assistant (draft) model."""

    def __init__(self, model, assistant=None, pad_token_id: int | None = None) -> None:
        self.model = model
        self.assistant = assistant
        self.pad_token_id = pad_token_id
        self._assistant_config = copy.deepcopy(assistant.generation_config) if assistant is not None else None

    @torch.inference_mode()
    def generate(
        self,
        prompt_ids: list[int],
        temperature: float,
        top_p: float,
        max_new_tokens: int,
        seed: int,
        eos_token_ids: list[int] | None,
    ) -> HFRun:
        cfg = generation_config(temperature, top_p, max_new_tokens, eos_token_ids, self.pad_token_id)
        kwargs = {}
        if self.assistant is not None:
            self.assistant.generation_config = copy.deepcopy(self._assistant_config)
            kwargs["assistant_model"] = self.assistant
        input_ids = torch.tensor([prompt_ids])  # [1, prompt_len]
        torch.manual_seed(seed)  # HF samples from the global generator
        t0 = time.perf_counter()
        out = self.model.generate(
            input_ids, attention_mask=torch.ones_like(input_ids), generation_config=cfg, **kwargs
        )  # [1, prompt_len + new]
        wall = time.perf_counter() - t0
        return HFRun(out[0, len(prompt_ids) :].tolist(), wall)

"""The decode loop: propose -> verify -> commit, for a batch of sequences with ragged acceptance.

Invariant: for every running sequence, the target's KV cache holds all of ``token_ids`` except the
last ("pending") token. One step feeds ``[pending, d_1 .. d_k]`` at positions ``len-1 .. len-1+k``,
verifies, and appends ``num_accepted + 1`` tokens; the cache is then valid for the new length minus
one, and stale entries past it are masked by position and overwritten later (rollback is free).
Target-only decoding is the same loop with ``k = 0``.

Running sequences always occupy slots ``0 .. n-1`` in order; when one finishes, the last one is
moved into its slot, so every forward addresses a contiguous block of the cache.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from specdecode.drafters.base import Drafter
from specdecode.metrics import SpecStats
from specdecode.models.runner import ModelRunner
from specdecode.policy import DraftPolicy, FixedPolicy
from specdecode.sampling import SamplingParams, make_generator, params_tensors, warp
from specdecode.text import IncrementalText
from specdecode.verify import verify_greedy, verify_speculative


class RequestError(ValueError):
    """A request the engine cannot serve (empty prompt, too long, bad token ids)."""


@dataclass(eq=False)  # identity semantics: sequences are compared and looked up by object
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    slot: int
    generator: torch.Generator
    text: IncrementalText
    token_ids: list[int] = field(default_factory=list)  # prompt + generated
    finish_reason: str | None = None  # "stop" (EOS or stop string) | "length" | "abort"
    stats: SpecStats = field(default_factory=SpecStats)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_ids) :]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class StepEvent:
    seq: Sequence
    new_token_ids: list[int]
    finished: bool


@dataclass
class Output:
    request_id: str
    prompt_ids: list[int]
    token_ids: list[int]  # generated ids (an EOS that ended the sequence is included)
    text: str  # cut before a stop string; special tokens skipped
    finish_reason: str
    stats: SpecStats


class Engine:
    def __init__(
        self,
        target: ModelRunner,
        tokenizer,
        drafter: Drafter | None = None,
        policy: DraftPolicy | int = 0,
        eos_token_ids: set[int] | None = None,
        max_batch_size: int | None = None,
        max_context: int | None = None,
    ) -> None:
        self.target = target
        self.tokenizer = tokenizer
        self.drafter = drafter
        self.policy = FixedPolicy(policy if drafter is not None else 0) if isinstance(policy, int) else policy
        self.eos_token_ids = set(eos_token_ids if eos_token_ids is not None else default_eos_ids(target.model, tokenizer))
        self.max_batch_size = max_batch_size or target.cache.num_slots
        self.max_context = max_context or target.max_len
        self.running: list[Sequence] = []
        self._ids = itertools.count()

    # -- admission ------------------------------------------------------------------------------
    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        if not prompt_ids:
            raise RequestError("the prompt is empty")
        bad = [t for t in prompt_ids if not (isinstance(t, int) and 0 <= t < self.target.vocab_size)]
        if bad:
            raise RequestError(f"prompt token id {bad[0]!r} is outside the vocabulary [0, {self.target.vocab_size})")
        if len(prompt_ids) + params.max_new_tokens > self.max_context:
            raise RequestError(
                f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({params.max_new_tokens}) "
                f"exceeds the context length {self.max_context}"
            )

    def free_slots(self) -> int:
        return self.max_batch_size - len(self.running)

    def has_capacity(self) -> bool:
        return self.free_slots() > 0

    def add(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None) -> Sequence:
        """Admit one request (see :meth:`add_batch`)."""
        return self.add_batch([(prompt_ids, params, request_id)])[0]

    def add_batch(self, requests: list[tuple[list[int], SamplingParams, str | None]]) -> list[Sequence]:
        """Admit requests into free slots and prefill target and drafter in one batched pass each
        (every prompt token but the last, which becomes the pending token)."""
        for prompt_ids, params, _ in requests:
            self.validate(prompt_ids, params)
        if len(self.running) + len(requests) > self.max_batch_size:
            raise RuntimeError("not enough free slots: check free_slots() first")
        seqs = [
            Sequence(
                request_id=request_id or f"req-{next(self._ids)}",
                prompt_ids=list(prompt_ids),
                params=params,
                slot=len(self.running) + i,
                generator=make_generator(params.seed),
                text=IncrementalText(self.tokenizer, params.stop),
                token_ids=list(prompt_ids),
            )
            for i, (prompt_ids, params, request_id) in enumerate(requests)
        ]
        t0 = time.perf_counter()
        slots = [s.slot for s in seqs]
        self.target.prefill(slots, [s.prompt_ids[:-1] for s in seqs])
        if self.drafter is not None:
            self.drafter.start(slots, [s.prompt_ids for s in seqs])
        elapsed = time.perf_counter() - t0
        for s in seqs:
            s.stats.prefill_s += elapsed
        self.running.extend(seqs)
        return seqs

    def abort(self, seq: Sequence) -> None:
        if seq in self.running:
            seq.finish_reason = seq.finish_reason or "abort"
            self._release(seq)

    # -- one step -------------------------------------------------------------------------------
    def step(self) -> list[StepEvent]:
        seqs = self.running
        if not seqs:
            return []
        bsz = len(seqs)
        # never draft past the token budget (the step emits k + 1 tokens at most)
        ks = [max(0, min(self.policy.num_draft(s, bsz), s.params.max_new_tokens - len(s.output_ids) - 1)) for s in seqs]

        t0 = time.perf_counter()
        if self.drafter is not None and any(ks):
            proposal = self.drafter.propose(seqs, ks)
            drafts, draft_probs, num_draft = proposal.tokens, proposal.probs, proposal.num_tokens
        else:
            drafts, draft_probs, num_draft = torch.zeros(bsz, 0, dtype=torch.long), None, torch.zeros(bsz, dtype=torch.long)
        t1 = time.perf_counter()

        k = drafts.shape[1]
        ids = torch.cat([torch.tensor([[s.token_ids[-1]] for s in seqs]), drafts], dim=1)  # [B, k+1]
        start = torch.tensor([len(s.token_ids) - 1 for s in seqs])
        positions = start[:, None] + torch.arange(k + 1)[None, :]  # [B, k+1]
        slots = torch.arange(bsz)
        logits = self.target.logits(self.target.forward(slots, ids, positions))  # [B, k+1, V]

        if all(s.params.greedy for s in seqs):
            result = verify_greedy(drafts, logits.argmax(-1), num_draft)
        else:
            temperature, top_k, top_p = (x.repeat_interleave(k + 1) for x in params_tensors([s.params for s in seqs]))
            target_probs = warp(logits.flatten(0, 1), temperature, top_k, top_p).view(bsz, k + 1, -1)
            if draft_probs is not None and draft_probs.shape[-1] != target_probs.shape[-1]:
                raise RuntimeError("draft and target distributions have different vocabulary sizes")
            result = verify_speculative(drafts, draft_probs, target_probs, num_draft, self._uniforms(seqs, num_draft, k))
        t2 = time.perf_counter()

        tokens = result.tokens.tolist()
        accepted = result.num_accepted.tolist()
        n_draft = num_draft.tolist()
        events = []
        for b, seq in enumerate(seqs):
            new = self._append(seq, tokens[b][: accepted[b] + 1])
            seq.stats.record_step(n_draft[b], accepted[b], len(new))
            self.policy.observe(seq, n_draft[b], accepted[b])
            seq.stats.draft_s += t1 - t0
            seq.stats.verify_s += t2 - t1
            events.append(StepEvent(seq, new, seq.finished))
        for ev in events:
            if ev.finished:
                self._release(ev.seq)
        return events

    def _uniforms(self, seqs: list[Sequence], num_draft: torch.Tensor, k: int) -> torch.Tensor:
        """[B, k+1]: each row draws its own ``num_draft + 1`` uniforms from its own generator, so a
        seeded sequence's randomness does not depend on the rest of the batch."""
        out = torch.zeros(len(seqs), k + 1)
        for b, (seq, n) in enumerate(zip(seqs, num_draft.tolist())):
            if seq.params.greedy:
                continue
            u = torch.rand(n + 1, generator=seq.generator)
            out[b, :n] = u[:n]
            out[b, k] = u[n]
        return out

    def _append(self, seq: Sequence, tokens: list[int]) -> list[int]:
        """Append verified tokens, cutting exactly at EOS, a stop string or the length limit."""
        new = []
        for tok in tokens:
            seq.token_ids.append(tok)
            new.append(tok)
            if tok in self.eos_token_ids and not seq.params.ignore_eos:
                seq.finish_reason = "stop"
            elif seq.text.add(tok):
                seq.finish_reason = "stop"
            elif len(seq.output_ids) >= seq.params.max_new_tokens or len(seq.token_ids) >= self.max_context:
                seq.finish_reason = "length"
            if seq.finished:
                break
        return new

    def _release(self, seq: Sequence) -> None:
        i = self.running.index(seq)
        last = self.running.pop()
        self.policy.forget(seq)
        if self.drafter is not None:
            self.drafter.release(seq.slot)
        if last is not seq:  # keep slots contiguous: move the last sequence into the freed slot
            self.target.cache.copy_slot(last.slot, i, len(last.token_ids) - 1)
            if self.drafter is not None:
                self.drafter.move(last.slot, i)
            last.slot = i
            self.running[i] = last

    # -- convenience ----------------------------------------------------------------------------
    def stream(self, prompts: list[list[int]], params: list[SamplingParams] | SamplingParams) -> Iterator[StepEvent]:
        """Run prompts to completion (admitting new ones as slots free up), yielding step events."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError("need one SamplingParams per prompt")
        for p, sp in zip(prompts, params_list):
            self.validate(p, sp)
        queue = [(p, sp, str(i)) for i, (p, sp) in enumerate(zip(prompts, params_list))]
        while queue or self.running:
            if queue and self.free_slots():
                admit, queue = queue[: self.free_slots()], queue[self.free_slots() :]
                self.add_batch(admit)
            yield from self.step()

    def generate(self, prompts: list[list[int]], params: list[SamplingParams] | SamplingParams) -> list[Output]:
        done: dict[str, Output] = {}
        for ev in self.stream(prompts, params):
            if ev.finished:
                s = ev.seq
                done[s.request_id] = Output(s.request_id, s.prompt_ids, s.output_ids, s.text.finish(), s.finish_reason, s.stats)
        return [done[str(i)] for i in range(len(prompts))]


def default_eos_ids(model, tokenizer) -> set[int]:
    ids: set[int] = set()
    gen_cfg = getattr(model, "generation_config", None)
    for source in (getattr(gen_cfg, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(int(x) for x in source)
    return ids
